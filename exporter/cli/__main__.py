"""`python -m exporter.cli`."""

from exporter.cli import entry

if __name__ == "__main__":
    entry()
