"""A strict test double of SGLang 0.5.23 (`python -m sglang.launch_server`), for tests only.

With `tests/sglang_double` on PYTHONPATH, `import sglang` finds this package instead of a real
install (SGLang needs a GPU). `launch_server` parses SGLang's command line, then serves the
built-in engine behind `strict.StrictSGLang`, a layer that enforces what SGLang's HTTP server and
TokenizerManager enforce and the built-in engine forgives (weight-update sessions, the
model-update lock, pause modes, the routes it has). Every rule cites the SGLang source it copies.
"""
