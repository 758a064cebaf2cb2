"""The figures as the sources leave them (immutable snapshots), and the pure functions over them:
the alert signals, the spend forecast, the anomaly statistics, an alert group's event record.
"""
