"""A TEST STAND-IN for SGLang in the SGLang emulator's image: `python -m sglang.launch_server` runs
the SGLang emulator (rolloutfleet_testkit.sglang_emulator) with SGLang's own flags. Not SGLang."""
