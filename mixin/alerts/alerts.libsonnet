// Alerts every user wants whatever the exporter's config: it is scraped, its sources refresh,
// its figures are fresh, its probes pass, its own notifications go out, its config and state
// file are good. Alerts on spend and budgets depend on the account: they are the exporter's
// own rules (`alerts.rules`), or the `rules` command's file for Prometheus.
{
  // `(account prod)` on an account's series of an exporter configured with `accounts`, else nothing.
  local account = '{{ with $labels.account }} (account {{ . }}){{ end }}',

  prometheusAlerts+:: {
    groups+: [
      {
        name: 'inference-cost-exporter',
        rules: [
          {
            alert: 'InferenceCostExporterDown',
            expr: 'up{%(exporterSelector)s} == 0' % $._config,
            'for': $._config.exporterDownFor,
            labels: { severity: 'warning' },
            annotations: {
              summary: 'inference-cost-exporter cannot be scraped.',
              description: (
                'Prometheus has failed to scrape {{ $labels.instance }} (job {{ $labels.job }}) for %(exporterDownFor)s: '
                + 'no bills, usage, budgets or probe figures are collected, and the alert rules the exporter evaluates '
                + 'itself are neither evaluated nor sent while it is down.'
              ) % $._config,
            },
          },
          {
            alert: 'InferenceCostExporterAbsent',
            expr: 'absent(up{%(exporterSelector)s})' % $._config,
            'for': $._config.exporterAbsentFor,
            labels: { severity: 'warning' },
            annotations: {
              summary: 'No inference-cost-exporter target is scraped.',
              description: (
                'Prometheus has had no target matching {%(exporterSelector)s} for %(exporterAbsentFor)s: the '
                + 'ServiceMonitor (or scrape config) does not select the exporter, or the exporter is not deployed. '
                + "Set the mixin's exporterSelector to the job Prometheus gives it."
              ) % $._config,
            },
          },
          {
            alert: 'InferenceCostRefreshFailing',
            expr: 'inference_exporter_refresh_success{%(exporterSelector)s, source!="history"} == 0' % $._config,
            'for': $._config.refreshFailingFor,
            labels: { severity: 'warning' },
            annotations: {
              summary: 'An inference-cost-exporter source keeps failing to refresh.',
              description: (
                'Every refresh of {{ $labels.source }}' + account + ' on {{ $labels.instance }} has failed for '
                + "%(refreshFailingFor)s. Its figures are the last good ones, and the exporter's rules on it keep "
                + 'their state. The landing page and the log line "refresh failed" name the error.'
              ) % $._config,
            },
          },
          {
            alert: 'InferenceCostHistoryFailing',
            expr: 'inference_exporter_refresh_success{%(exporterSelector)s, source="history"} == 0' % $._config,
            'for': $._config.historyFailingFor,
            labels: { severity: 'warning' },
            annotations: {
              summary: 'inference-cost-exporter cannot fetch past months of bills.',
              description: (
                'Every refresh of the history' + account + ' on {{ $labels.instance }} has failed for '
                + '%(historyFailingFor)s: some past months are missing (the log line "refresh failed" names them). '
                + 'The anomaly rules and the forecast learn from the months it holds.'
              ) % $._config,
            },
          },
          {
            alert: 'InferenceCostDataStale',
            expr: |||
              time() - inference_exporter_last_refresh_success_timestamp_seconds{%(exporterSelector)s}
                > %(dataStaleSeconds)s
            ||| % $._config,
            'for': $._config.dataStaleFor,
            labels: { severity: 'warning' },
            annotations: {
              summary: 'inference-cost-exporter figures are stale.',
              description: (
                'The last successful refresh of {{ $labels.source }}' + account + ' on {{ $labels.instance }} was '
                + '{{ $value | humanizeDuration }} ago (the limit is %(dataStaleSeconds)s s): its refreshes fail '
                + 'or no longer run. /metrics serves the last good figures meanwhile.'
              ) % $._config,
            },
          },
          {
            alert: 'InferenceCostProbeFailing',
            expr: 'inference_probe_success{%(exporterSelector)s} == 0' % $._config,
            'for': $._config.probeFailingFor,
            labels: { severity: 'warning' },
            annotations: {
              summary: 'An inference endpoint fails its synthetic probe.',
              description: (
                'Probe {{ $labels.probe }} ({{ $labels.scenario }} on {{ $labels.endpoint_id }})' + account
                + ' has failed every run for %(probeFailingFor)s. inference_probe_failures_total{reason} says why, '
                + 'and inference_probe_check_success which check failed.'
              ) % $._config,
            },
          },
          {
            alert: 'InferenceCostNotificationsFailing',
            expr: |||
              increase(inference_alert_notifications_failed_total{%(exporterSelector)s}[%(notificationsWindow)s]) > 0
              unless
              increase(inference_alert_notifications_total{%(exporterSelector)s}[%(notificationsWindow)s]) > 0
            ||| % $._config,
            'for': $._config.notificationsFailingFor,
            labels: { severity: 'warning' },
            annotations: {
              summary: 'inference-cost-exporter cannot deliver its notifications.',
              description: (
                'Every delivery to notifier {{ $labels.notifier }} on {{ $labels.instance }} has failed for '
                + "%(notificationsFailingFor)s, and none got through: the exporter's own alerts do not reach that "
                + "receiver. They wait in the outbox and are retried; the log names the receiver's answer."
              ) % $._config,
            },
          },
          {
            alert: 'InferenceCostNotificationsRefused',
            expr: |||
              increase(inference_alert_notifications_discarded_total{%(exporterSelector)s, reason="refused"}[%(notificationsRefusedWindow)s]) > 0
            ||| % $._config,
            'for': '0m',  // (a drop is told once: the increase is the whole of it)
            labels: { severity: 'warning' },
            annotations: {
              summary: 'inference-cost-exporter dropped notifications their receiver refused.',
              description: (
                'On {{ $labels.instance }}, notifications were dropped in the last %(notificationsRefusedWindow)s: '
                + 'their receiver refused them outright 5 times in a row, or email recipients still refused them after '
                + 'a day. Those alerts never reached them; the log names the notifier and its answer (a 4xx: the URL, '
                + 'the token).'
              ) % $._config,
            },
          },
          {
            alert: 'InferenceCostNotificationBacklog',
            expr: 'inference_alert_notifications_pending{%(exporterSelector)s} > 0' % $._config,
            'for': $._config.notificationBacklogFor,
            labels: { severity: 'warning' },
            annotations: {
              summary: 'inference-cost-exporter notifications are piling up in its outbox.',
              description: (
                'The outbox of notifier {{ $labels.notifier }} on {{ $labels.instance }} has not emptied for '
                + '%(notificationBacklogFor)s ({{ $value }} waiting now): its receiver is down, slow or refusing.'
              ) % $._config,
            },
          },
          {
            alert: 'InferenceCostConfigReloadFailed',
            expr: 'inference_exporter_config_last_reload_successful{%(exporterSelector)s} == 0' % $._config,
            'for': $._config.configReloadFailedFor,
            labels: { severity: 'warning' },
            annotations: {
              summary: 'inference-cost-exporter refused its new config.',
              description: (
                '{{ $labels.instance }} refused the config of its last reload and has run on the one it had for '
                + '%(configReloadFailedFor)s or more. `inference-cost-exporter check --config FILE` lists every problem.'
              ) % $._config,
            },
          },
          {
            alert: 'InferenceCostStateWriteFailing',
            expr: 'inference_exporter_state_write_success{%(exporterSelector)s} == 0' % $._config,
            'for': $._config.stateWriteFailingFor,
            labels: { severity: 'warning' },
            annotations: {
              summary: 'inference-cost-exporter cannot write its state file.',
              description: (
                'Writes to the state file' + account + ' of {{ $labels.instance }} have failed for '
                + '%(stateWriteFailingFor)s: alert states, the notification outbox and the usage cursor are not '
                + 'saved, so a restart would lose them. The log names the file and the fault (a full or read-only volume).'
              ) % $._config,
            },
          },
          {
            alert: 'InferenceCostClockSkew',
            expr: 'abs(inference_exporter_clock_skew_seconds{%(exporterSelector)s}) > %(clockSkewSeconds)s' % $._config,
            'for': $._config.clockSkewFor,
            labels: { severity: 'warning' },
            annotations: {
              summary: "The clock of inference-cost-exporter's host is off.",
              description: (
                "The billing API's clock and that of {{ $labels.instance }}" + account + ' differ by '
                + "{{ $value | humanizeDuration }}: signatures get refused (the exporter then signs with the API's "
                + "time), and this host's days and timestamps are off. Fix the host's time (NTP)."
              ) % $._config,
            },
          },
        ],
      },
    ],
  },
}
