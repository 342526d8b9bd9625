"""Starting engines and routers: as local child processes (more launchers come with scale-out)."""
