"""What the gateway, the worker and the launcher share: the protocol, the route table, settings.

Also the API keys file, the CURVE key files, logging, and the ZeroMQ I/O
helpers; it imports neither side (an import-linter contract).
"""
