// The inference-cost-exporter monitoring mixin: alerts, recording rules and the Grafana dashboard,
// all configured by `_config` (config.libsonnet). Override it on the right:
//   (import 'mixin.libsonnet') + { _config+:: { exporterSelector: 'job="costs"' } }
(import 'config.libsonnet') +
(import 'alerts/alerts.libsonnet') +
(import 'rules/rules.libsonnet') +
(import 'dashboards/dashboards.libsonnet')
