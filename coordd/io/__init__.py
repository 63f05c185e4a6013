"""The daemon's I/O shell: the uvloop + ROUTER server (`server`) that carries out the core's
decisions, socket options and routing ids (`identity`), the ZAP gates (`gate`, `curve`), the
listener's path (`listen`), connection caps (`limits`) and the memory reader (`memory`)."""
