"""``python -m toolguard.gateway.example``: the example ticket board over stdio."""

import os

os.environ.setdefault("FASTMCP_LOG_LEVEL", "WARNING")  # stderr stays for real problems

from toolguard.gateway.example.server import build_server

if __name__ == "__main__":
    build_server().run(transport="stdio", show_banner=False)
