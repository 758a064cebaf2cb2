"""Notifiers: delivering alerts and digests to receivers, one module per kind.

- `kind`: what a kind implements (`OutboxKind`, `ResendKind`) and what it sends through (`Delivery`);
- `registry`: the kinds by the config's `type`; adding a kind is its module and one entry there
  (and its config model in `exporter.schema`);
- `alertmanager`, `webhook`, `slack`, `pagerduty`, `email`: the kinds, each its format and send;
- `dispatcher`: the workers, the outbox and retries, for every notifier whatever its kind;
- `post` and `smtp`: one HTTP POST or one SMTP exchange under one deadline.
"""
