"""The local launcher behind `make run`: `python -m services.launcher` (cli.py), and `Stack` (stack.py),
the same as a library."""

from services.launcher.redis_server import RedisServer, StackError, free_port
from services.launcher.stack import Stack, StackConfig

__all__ = ["RedisServer", "Stack", "StackConfig", "StackError", "free_port"]
