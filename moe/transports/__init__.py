"""Transports from the router to expert holders: the agent WebSocket through the channel layer
(``ws``), holders' HTTP endpoints (``http``) and their iroh QUIC endpoints (``iroh``)."""
