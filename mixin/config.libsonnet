// The dashboard's own title, uid and tags are the defaults: grafana/ stays their one source.
local dashboard = import '../grafana/inference-cost-exporter.json';

{
  _config+:: {
    // Goes between the braces of every series the alerts and rules read, and narrows the
    // dashboard's job list. kube-prometheus' ServiceMonitor sets `job` to the Service's name.
    exporterSelector: 'job="inference-cost-exporter"',

    // The labels that tell one exporter from another: joins with
    // `inference_billing_today_info` match on them (add `cluster` when one Prometheus, Thanos or
    // Mimir holds several clusters).
    instanceLabels: ['job', 'instance'],

    // How long each condition holds before its alert fires.
    exporterDownFor: '5m',
    exporterAbsentFor: '15m',
    // Longer than one refresh interval of the slowest source, so that one failed refresh retried
    // at the next interval does not page (bills: 15 min by default).
    refreshFailingFor: '30m',
    // The history's: longer than the hour a past month that failed on its own waits before it is
    // fetched again (every refresh meanwhile says the month is missing), so one failure does not page.
    historyFailingFor: '2h',
    dataStaleFor: '5m',
    probeFailingFor: '15m',
    notificationsFailingFor: '15m',
    notificationBacklogFor: '30m',
    configReloadFailedFor: '5m',
    stateWriteFailingFor: '10m',
    clockSkewFor: '10m',

    // Data older than this (seconds since the source's last successful refresh) is stale. Keep it
    // well above your longest refresh interval (`billing.bills_interval`, a probe's `interval`).
    dataStaleSeconds: 7200,
    // The exporter warns in its log beyond a minute (the billing API refuses signatures then,
    // and the exporter falls back to signing with the API's time).
    clockSkewSeconds: 60,
    // The window over which delivery failures are weighed against deliveries.
    notificationsWindow: '10m',
    // The window in which a notification dropped as refused alerts (it is told once, not retried).
    notificationsRefusedWindow: '1h',
    // The window of the probe failure ratio recording rule (its name ends in it).
    probeFailureRatioWindow: '1h',

    dashboardTitle: dashboard.title,
    dashboardUid: dashboard.uid,
    dashboardTags: dashboard.tags,
  },
}
