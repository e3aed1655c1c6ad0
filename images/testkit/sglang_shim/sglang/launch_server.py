"""`python -m sglang.launch_server ARGS` in the test kit's image (a test stand-in)."""

from rolloutfleet_testkit.upstream_stub import sglang_main

if __name__ == "__main__":
    sglang_main()
