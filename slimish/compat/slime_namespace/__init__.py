"""Not a module to import: this directory goes on `sys.path` (slimish.compat.slime.namespace.use_slime_namespace)
so that `import slime...` finds slimish's stand-in `slime` package when no real slime is installed.
It has an `__init__.py` only so that setuptools' package discovery ships the files below it."""
