"""slimish's stand-in for slime (github THUDM/slime): the names slime's custom generate, reward and
filter functions import, mapped onto slimish (`slimish.compat.slime`). Put on `sys.path` only when
a `slime:` spec is loaded and no real slime is installed."""

STAND_IN = True  # the real slime has no such name
