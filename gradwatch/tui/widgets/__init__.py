"""One widget per file; each takes plain values (or a RunState) and never touches a socket."""
