// The dashboard is grafana/inference-cost-exporter.json itself, imported, not copied: only what
// `_config` asks for changes (title, uid, tags, and every query narrowed by exporterSelector).
local dashboard = import '../../grafana/inference-cost-exporter.json';

{
  local jobs = 'inference_exporter_build_info,',
  local selectedJobs = 'inference_exporter_build_info{%(exporterSelector)s},' % $._config,
  local narrowed(text) =
    assert std.length(std.findSubstr(jobs, text)) == 1 : 'the job variable no longer reads %s' % jobs;
    std.strReplace(text, jobs, selectedJobs),
  // Every query's job matcher is followed by the selector, so that its other matchers (a
  // namespace) narrow what the panels show too, not only the list of jobs.
  local job = 'job=~"$job"',
  local scoped(text) =
    assert std.length(std.findSubstr(job, text)) > 0 : 'a query does not read %s: %s' % [job, text];
    std.strReplace(text, job, '%s, %s' % [job, $._config.exporterSelector]),

  grafanaDashboards+:: {
    'inference-cost-exporter.json': dashboard {
      title: $._config.dashboardTitle,
      uid: $._config.dashboardUid,
      tags: $._config.dashboardTags,
      panels: [
        panel + (
          if std.objectHas(panel, 'targets')
          then { targets: [target { expr: scoped(super.expr) } for target in panel.targets] }
          else {}
        )
        for panel in super.panels
      ],
      templating+: {
        list: [
          // All is every job listed (the selector's), not `.*`: any job at all.
          if variable.name == 'job'
          then variable { definition: narrowed(super.definition), query+: { query: narrowed(super.query) }, allValue: null }
          else if std.objectHas(variable, 'definition')
          then variable { definition: scoped(super.definition), query+: { query: scoped(super.query) } }
          else variable
          for variable in super.list
        ],
      },
    },
  },
}
