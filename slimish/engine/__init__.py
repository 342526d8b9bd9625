"""The built-in engine: a real transformer server speaking SGLang's native protocol."""
