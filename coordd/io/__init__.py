"""The daemon's I/O shell: the uvloop + ROUTER server (`server`: drain, monitor, and carrying
out the registry's actions), its socket set up and bound (`router`), the shell side of
admission (`guard`: shutdowns, the grace timer, the memory watch), the one deadline timer
(`timer`), routing ids (`identity`), the ZAP gates (`gate`, `curve`), the listener's path
(`listen`), what admission asks of the OS (`limits`) and the memory reader (`memory`)."""
