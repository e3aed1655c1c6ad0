"""A TEST STAND-IN for SGLang in the test kit's image, on PYTHONPATH only where a fleet's engines ask
for it (`engines.env`): `python -m sglang.launch_server` runs the fixed-latency stand-in
(rolloutfleet_testkit.upstream_stub) with SGLang's own flags. Not SGLang, and no model."""
