"""The service side works without LangGraph or LangChain installed."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_the_middlewares_import_without_langgraph_or_langchain():
    script = textwrap.dedent("""
        import sys
        class Blocked:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in ("langgraph", "langchain", "langchain_core"):
                    raise ImportError(f"{name} is blocked in this test")
        sys.meta_path.insert(0, Blocked())
        import toolguard.fences.asgi, toolguard.fences.mcp_server, toolguard.fences.http_client
        from toolguard.fences import FenceMiddleware, FenceToolMiddleware, FencedClient
        print("ok")
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"
