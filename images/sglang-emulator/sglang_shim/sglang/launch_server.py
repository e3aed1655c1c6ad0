"""`python -m sglang.launch_server ARGS` in the SGLang emulator's image (a test stand-in)."""

from rolloutfleet_testkit.sglang_emulator.sglang_cli import main

if __name__ == "__main__":
    main()
