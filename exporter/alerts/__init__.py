"""Budget and threshold alerts: rules over snapshots, a durable state machine, notifiers."""
