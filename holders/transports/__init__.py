"""Transports from the router to expert holders (agent WebSocket through the channel layer)."""
