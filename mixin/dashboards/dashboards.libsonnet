// The dashboard is grafana/inference-cost-exporter.json itself, imported, not copied: only what
// `_config` asks for changes (title, uid, tags, and the job list narrowed by exporterSelector).
local dashboard = import '../../grafana/inference-cost-exporter.json';

{
  local jobs = 'inference_exporter_build_info,',
  local selectedJobs = 'inference_exporter_build_info{%(exporterSelector)s},' % $._config,
  local narrowed(text) =
    assert std.length(std.findSubstr(jobs, text)) == 1 : 'the job variable no longer reads %s' % jobs;
    std.strReplace(text, jobs, selectedJobs),

  grafanaDashboards+:: {
    'inference-cost-exporter.json': dashboard {
      title: $._config.dashboardTitle,
      uid: $._config.dashboardUid,
      tags: $._config.dashboardTags,
      templating+: {
        list: [
          if variable.name == 'job'
          then variable { definition: narrowed(super.definition), query+: { query: narrowed(super.query) } }
          else variable
          for variable in super.list
        ],
      },
    },
  },
}
