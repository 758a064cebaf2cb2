// Recording rules, named level:metric:operations. They keep every label of the exporter's target
// (job, instance, and those your scrape adds) and its `account`: an HA pair of exporters records
// one series each, never a sum of the two.
{
  local on = std.join(', ', $._config.instanceLabels),
  // Only the current month's series: the exporter also serves last month's during its grace days.
  local currentMonth(metric) = |||
    sum without (period) (
      %(metric)s{%(exporterSelector)s}
      and on (%(on)s, period)
      inference_billing_today_info{%(exporterSelector)s}
    )
  ||| % ($._config { metric: metric, on: on }),

  prometheusRules+:: {
    groups+: [
      {
        name: 'inference-cost-exporter.rules',
        rules: [
          {
            // The payable amount of the current month so far, per account.
            record: 'account:inference_bill_month_to_date_payable_amount:sum',
            expr: currentMonth('inference_bill_month_to_date_payable_amount'),
          },
          {
            // The current month's projected payable amount at its end, per account.
            record: 'account:inference_bill_month_forecast_payable_amount:sum',
            expr: currentMonth('inference_bill_month_forecast_payable_amount'),
          },
          {
            // The share of a probe's runs that failed, whatever the reason; 0 when none failed,
            // nothing when the probe did not run in the window.
            record: 'probe:inference_probe_failures_per_runs:ratio_rate%(probeFailureRatioWindow)s' % $._config,
            expr: |||
              (
                sum without (reason) (rate(inference_probe_failures_total{%(exporterSelector)s}[%(probeFailureRatioWindow)s]))
                or
                rate(inference_probe_runs_total{%(exporterSelector)s}[%(probeFailureRatioWindow)s]) * 0
              )
              /
              (rate(inference_probe_runs_total{%(exporterSelector)s}[%(probeFailureRatioWindow)s]) > 0)
            ||| % $._config,
          },
        ],
      },
    ],
  },
}
