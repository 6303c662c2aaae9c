"""Private servers for the idle-state tests (each test gets its own)."""

from pg_server import private_postgres  # noqa: F401  (fixture)
from servers import private_redis  # noqa: F401  (fixture)
