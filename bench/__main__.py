"""Run every benchmark: `make bench` or `python -m bench`."""

from bench import faults, probe, render, sync

if __name__ == "__main__":
    sync.main([])
    render.main([])
    probe.main([])
    faults.main([])
