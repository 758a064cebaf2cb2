"""Alert rules over the snapshots: an alert and its identity (`alert`), the engine (each rule's
alerts as a durable state machine, across accounts), budget tiers, anomaly rules, and the same
rules written as Prometheus rules (`promrules`).
"""
