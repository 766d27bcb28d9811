"""The remote tier (Redis/Valkey, shared by hosts): ``tier``, ``link`` (the connection), ``directory``."""
