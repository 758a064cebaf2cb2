"""Alert rules over the snapshots: the engine (each rule's alerts as a durable state machine), budget
tiers, anomaly rules, and the same rules written as Prometheus rules (`promrules`).
"""
