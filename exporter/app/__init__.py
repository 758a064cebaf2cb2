"""The composition root: the daemon that builds the sources, schedules refreshes, serves and
reloads, and stops cleanly.
"""
