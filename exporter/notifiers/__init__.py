"""Each kind of notifier (`webhook`, `slack`, `pagerduty`, `email`, `alertmanager`): its message and
how it is sent, behind a registry keyed by the config's `type` (`registry`).
"""
