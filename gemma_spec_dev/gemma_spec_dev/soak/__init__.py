"""``gemma-spec-soak``: the node served as a subprocess and driven like a busy robot (see :mod:`.cli`).

- ``cli``: the command (arguments, then the run, then the report written out);
- ``scenario``: what is sent: goals valid and invalid, cancel points, parameter values, cycles;
- ``driver``: the server subprocess and the threads that drive it through one GenerateClient;
- ``remote_phase``: the optional phase on a real llama-server, frozen with SIGSTOP;
- ``records``: what a run writes down (goals, samples) and hands to the report;
- ``procfs``: the server's RSS, threads and open files from /proc;
- ``report``: the PASS/FAIL checks, the metrics, soak.md and rss.svg.
"""
