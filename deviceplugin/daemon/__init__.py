"""The node agent: what it starts from, how it wires the core to both front-ends, and its life.

`startup` holds the run options and the steps before serving (config, plan, answers restored
after a reboot); `backends` is what the daemon hands its servers and metrics; `lifecycle`
runs the parts, reloads them and stops them in order. The only package that imports both
front-ends; only `cli` (and the simulated node) import it.
"""
