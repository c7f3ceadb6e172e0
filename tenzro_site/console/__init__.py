"""The operator console: server-rendered pages over the registry, holders and prepare services.

Views (``views``) stay thin: they parse input with forms (``forms``), read through
``selectors`` and write through the apps' services (``registry.governance``). Pages that
follow (receipts, disputes, settlement, repair) add a selector, a view, a template and one
``nav.NAV`` entry.
"""
