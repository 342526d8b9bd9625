"""slime.utils as slimish provides it: `types` (Sample), `http_utils` (post, get), `misc` (load_function)."""
