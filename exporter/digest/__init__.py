"""The scheduled digest: what it says (`build`, from the snapshots and the alerts; how it reads is
each notifier kind's, in `exporter.notifiers.digest`)."""
