"""What users apply on Kubernetes: deploy/kubernetes/ rendered by `kubectl kustomize` (the base alone,
and the example overlay with every component), each object checked against the Kubernetes API schemas,
and what the objects say to each other and to the exporter checked too.

`UPDATE_KUBERNETES=1 pytest tests/test_kubernetes.py` regenerates the PrometheusRule's groups from the
`rules` command after a deliberate change.
"""

from __future__ import annotations

import base64
import copy
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path, PurePosixPath
from typing import Any

import kubernetes_validate
import pytest
import yaml

from exporter.alerts.promrules import rule_file
from exporter.config.load import validate
from exporter.config.schema import Config
from tests.conftest import require_binary
from tests.test_deploy import config_variables, notifier_destinations, url_destination

ROOT = Path(__file__).parent.parent
KUBERNETES = ROOT / "deploy" / "kubernetes"
BASE = KUBERNETES / "base"
EXAMPLE = KUBERNETES / "example"
PROMETHEUS_RULE = KUBERNETES / "components" / "prometheusrule" / "prometheusrule.yaml"
DOCS = ROOT / "docs" / "kubernetes.md"
NAME = "inference-cost-exporter"
SELECTOR = {"app.kubernetes.io/name": NAME, "app.kubernetes.io/instance": NAME}

SCHEMA_VERSIONS = ("1.25", kubernetes_validate.latest_version())
"""The oldest Kubernetes whose schemas kubernetes-validate ships (Pod Security admission is GA since
1.25) and the newest."""
RELEASE = {"release": "kube-prometheus-stack"}
"""What kube-prometheus-stack's Prometheus selects ServiceMonitors and PrometheusRules by, by default:
its templates/prometheus/prometheus.yaml writes `matchLabels: {release: <Helm release name>}` for both
while serviceMonitorSelectorNilUsesHelmValues and ruleSelectorNilUsesHelmValues are true, as its
values.yaml has them (prometheus-community/helm-charts, chart 88.5.3)."""
OPERATOR_GROUP = "monitoring.coreos.com"
"""The Prometheus Operator's API group: its kinds are custom resources kubernetes-validate has no schema for."""
DURATION = re.compile(r"0|(?=\d)(\d+y)?(\d+w)?(\d+d)?(\d+h)?(\d+m)?(\d+s)?(\d+ms)?")
"""A Prometheus duration, as the operator's CRDs accept it (`10m`, `1h30m`, `600s`)."""
RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
                      "projected", "secret"}  # fmt: skip
"""The volume types the Pod Security Standard "restricted" allows."""


def render(directory: Path) -> list[dict[str, Any]]:
    kubectl = require_binary("kubectl")
    result = subprocess.run([kubectl, "kustomize", str(directory)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return [document for document in yaml.safe_load_all(result.stdout) if document]


@pytest.fixture(scope="module")
def base() -> list[dict[str, Any]]:
    return render(BASE)


@pytest.fixture(scope="module")
def example() -> list[dict[str, Any]]:
    return render(EXAMPLE)


@pytest.fixture(params=["base", "example"])
def rendered(request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    """Each of the two: what holds for the base must hold once the components are added."""
    return request.getfixturevalue(request.param)


def one(objects: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    (found,) = (o for o in objects if o["kind"] == kind)
    return found


def placeholders(text: str) -> dict[str, str]:
    """The environment variables a config references, set to placeholders."""
    return {name: f"placeholder-{name.lower()}" for name in sorted(config_variables(text))}


def config_text(objects: list[dict[str, Any]]) -> str:
    return one(objects, "ConfigMap")["data"]["config.yaml"]


def exporter_config(objects: list[dict[str, Any]]) -> Config:
    text = config_text(objects)
    return validate(yaml.safe_load(text), placeholders(text))


# --- every object against its schema ------------------------------------------------------------


def custom_resource_problems(resource: dict[str, Any]) -> list[str]:
    """The fields the Prometheus Operator's CRDs require (spec; a ServiceMonitor's selector and
    endpoints; a rule group's name; a rule's expr) and the shapes the operator accepts, checked here:
    kubernetes-validate knows only Kubernetes' own kinds."""
    problems = []
    where = f"{resource.get('kind')}/{resource.get('metadata', {}).get('name')}"
    if resource.get("apiVersion") != f"{OPERATOR_GROUP}/v1":
        problems.append(f"{where}: apiVersion {resource.get('apiVersion')!r}, not {OPERATOR_GROUP}/v1")
    if not isinstance(resource.get("metadata", {}).get("name"), str):
        problems.append(f"{where}: metadata.name is missing")
    spec = resource.get("spec")
    if not isinstance(spec, dict):
        return [*problems, f"{where}: spec is missing"]
    if resource["kind"] == "ServiceMonitor":
        selector = spec.get("selector")
        if not isinstance(selector, dict) or not (selector.get("matchLabels") or selector.get("matchExpressions")):
            problems.append(f"{where}: spec.selector selects nothing")
        endpoints = spec.get("endpoints")
        if not isinstance(endpoints, list) or not endpoints:
            problems.append(f"{where}: spec.endpoints is missing")
        for n, endpoint in enumerate(endpoints or []):
            if not isinstance(endpoint.get("port"), str):
                problems.append(f"{where}: spec.endpoints[{n}].port: not a port name")
            for key in ("interval", "scrapeTimeout"):
                if key in endpoint and not DURATION.fullmatch(str(endpoint[key])):
                    problems.append(f"{where}: spec.endpoints[{n}].{key}: not a duration")
    elif resource["kind"] == "PrometheusRule":
        groups = spec.get("groups")
        if not isinstance(groups, list) or not groups:
            problems.append(f"{where}: spec.groups is missing")
        for g, group in enumerate(groups or []):
            at = f"{where}: spec.groups[{g}]"
            if not isinstance(group.get("name"), str) or not group["name"]:
                problems.append(f"{at}.name is missing")
            if "interval" in group and not DURATION.fullmatch(str(group["interval"])):
                problems.append(f"{at}.interval: not a duration")
            for r, rule in enumerate(group.get("rules") or []):
                if not isinstance(rule.get("expr"), str | int) or rule.get("expr") == "":
                    problems.append(f"{at}.rules[{r}].expr is missing")
                if ("alert" in rule) == ("record" in rule):
                    problems.append(f"{at}.rules[{r}]: needs either `alert` or `record`")
                for key in ("for", "keep_firing_for"):
                    if key in rule and not DURATION.fullmatch(str(rule[key])):
                        problems.append(f"{at}.rules[{r}].{key}: not a duration")
                for key in ("labels", "annotations"):
                    values = rule.get(key, {})
                    if not isinstance(values, dict) or not all(isinstance(v, str) for v in values.values()):
                        problems.append(f"{at}.rules[{r}].{key}: not a mapping of strings")
    else:
        problems.append(f"{where}: no check for this kind")
    return problems


def schema_problems(objects: list[dict[str, Any]]) -> list[str]:
    """Every object against the Kubernetes API schemas (strict: an unknown field is a problem). A kind
    kubernetes-validate has no schema for raises SchemaNotFoundError: nothing passes unchecked."""
    problems = []
    for resource in objects:
        if resource["apiVersion"].split("/")[0] == OPERATOR_GROUP:
            problems += custom_resource_problems(resource)
            continue
        for version in SCHEMA_VERSIONS:
            try:
                kubernetes_validate.validate(resource, version, strict=True)
            except kubernetes_validate.ValidationError as error:
                path = ".".join(str(part) for part in error.path)
                problems.append(
                    f"{resource['kind']}/{resource['metadata']['name']} ({version}): {path}: {error.message}"
                )
    return problems


@pytest.mark.integration  # kubectl
def test_every_object_is_valid_for_the_kubernetes_api(rendered: list[dict[str, Any]]) -> None:
    assert schema_problems(rendered) == []


@pytest.mark.integration  # kubectl
def test_the_example_adds_every_component_in_one_restricted_namespace(
    base: list[dict[str, Any]], example: list[dict[str, Any]]
) -> None:
    assert sorted(o["kind"] for o in base) == ["ConfigMap", "Deployment", "PersistentVolumeClaim", "Service"]
    assert sorted(o["kind"] for o in example) == [
        "ConfigMap", "Deployment", "Namespace", "NetworkPolicy", "PersistentVolumeClaim", "PrometheusRule", "Service",
        "ServiceMonitor",
    ]  # fmt: skip
    namespace = one(example, "Namespace")["metadata"]
    assert {o["metadata"].get("namespace") for o in example if o["kind"] != "Namespace"} == {namespace["name"]}
    assert namespace["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"


def test_the_schema_check_finds_a_broken_object() -> None:
    """The checks above can fail: a typo in a field, a wrong type, a ServiceMonitor or PrometheusRule
    missing what the operator requires."""
    deployment = yaml.safe_load((BASE / "deployment.yaml").read_text())
    assert schema_problems([deployment]) == []
    typo = copy.deepcopy(deployment)
    typo["spec"]["template"]["spec"]["containers"][0]["securityContext"]["readOnlyRootFileSystem"] = True
    wrong_type = copy.deepcopy(deployment)
    wrong_type["spec"]["replicas"] = "one"
    for broken in (typo, wrong_type):
        assert len(schema_problems([broken])) == len(SCHEMA_VERSIONS)
    monitor = yaml.safe_load((KUBERNETES / "components" / "servicemonitor" / "servicemonitor.yaml").read_text())
    rule = yaml.safe_load(PROMETHEUS_RULE.read_text())
    assert schema_problems([monitor, rule]) == []
    no_selector = copy.deepcopy(monitor)
    del no_selector["spec"]["selector"]
    bad_interval = copy.deepcopy(monitor)
    bad_interval["spec"]["endpoints"][0]["interval"] = "1 minute"
    no_expr = copy.deepcopy(rule)
    del no_expr["spec"]["groups"][0]["rules"][0]["expr"]
    no_name = copy.deepcopy(rule)
    del no_name["spec"]["groups"][0]["name"]
    for broken in (no_selector, bad_interval, no_expr, no_name):
        assert len(schema_problems([broken])) == 1, broken


# --- the pod ------------------------------------------------------------------------------------


def effective_security(pod: dict[str, Any], container: dict[str, Any]) -> dict[str, Any]:
    """A container's security settings, its own over the pod's where both may set them."""
    own, shared = container.get("securityContext", {}), pod.get("securityContext", {})
    return {
        "runAsNonRoot": own.get("runAsNonRoot", shared.get("runAsNonRoot")),
        "runAsUser": own.get("runAsUser", shared.get("runAsUser")),
        "seccompProfile": own.get("seccompProfile", shared.get("seccompProfile")),
        "allowPrivilegeEscalation": own.get("allowPrivilegeEscalation"),
        "privileged": own.get("privileged", False),
        "capabilities": own.get("capabilities"),
        "readOnlyRootFilesystem": own.get("readOnlyRootFilesystem"),
    }


@pytest.mark.integration  # kubectl
def test_every_container_meets_the_restricted_pod_security_standard(rendered: list[dict[str, Any]]) -> None:
    user = int(re.search(r"^USER (\d+)$", (ROOT / "Dockerfile").read_text(), flags=re.MULTILINE)[1])
    pod = one(rendered, "Deployment")["spec"]["template"]["spec"]
    containers = [*pod.get("initContainers", []), *pod["containers"]]
    assert containers
    for container in containers:
        assert effective_security(pod, container) == {
            "runAsNonRoot": True,
            "runAsUser": user,  # the image's own user, so the files it owns in the image are its
            "seccompProfile": {"type": "RuntimeDefault"},
            "allowPrivilegeEscalation": False,
            "privileged": False,
            "capabilities": {"drop": ["ALL"]},
            "readOnlyRootFilesystem": True,
        }, container["name"]
    assert not any(pod.get(key) for key in ("hostNetwork", "hostPID", "hostIPC"))
    volume_types = {key for volume in pod["volumes"] for key in volume if key != "name"}
    assert volume_types <= RESTRICTED_VOLUMES
    assert pod["automountServiceAccountToken"] is False


@pytest.mark.integration  # kubectl
def test_the_state_file_is_on_its_own_volume_with_one_replica(rendered: list[dict[str, Any]]) -> None:
    """The state file's lock admits one exporter, and a ReadWriteOnce volume one node: one replica,
    and the old pod gone before the new one starts."""
    deployment = one(rendered, "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    claim = one(rendered, "PersistentVolumeClaim")
    assert set(claim["spec"]["accessModes"]) <= {"ReadWriteOnce", "ReadWriteOncePod"}
    volumes = {volume["name"]: volume for volume in pod["volumes"]}
    mounts = {mount["mountPath"]: mount for mount in container["volumeMounts"]}
    state = PurePosixPath(exporter_config(rendered).state.path)
    state_mount = max((path for path in mounts if state.is_relative_to(path)), key=len)
    on = volumes[mounts[state_mount]["name"]]
    assert on["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
    assert not mounts[state_mount].get("readOnly")
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}
    # The root filesystem is read-only: temporary files go to an emptyDir.
    assert "emptyDir" in volumes[mounts["/tmp"]["name"]]


@pytest.mark.integration  # kubectl
def test_the_config_in_the_config_map_is_valid_and_served_where_the_probes_look(
    rendered: list[dict[str, Any]],
) -> None:
    config = exporter_config(rendered)  # validates: every problem raises ConfigError
    pod = one(rendered, "Deployment")["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    config_map = one(rendered, "ConfigMap")["metadata"]["name"]
    mount = next(m for m in container["volumeMounts"] if m["name"] == "config")
    volume = next(v for v in pod["volumes"] if v["name"] == "config")
    assert volume["configMap"]["name"] == config_map
    assert container["args"] == ["--config", f"{mount['mountPath']}/config.yaml"]
    ports = {port["name"]: port["containerPort"] for port in container["ports"]}
    assert ports == {"metrics": int(config.server.listen.rsplit(":", 1)[1])}
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    assert set(container["resources"]) == {"requests", "limits"}


@pytest.mark.integration  # kubectl
def test_credentials_come_from_a_secret_that_is_not_shipped(rendered: list[dict[str, Any]]) -> None:
    """The pod takes the whole Secret as its environment; the Secret is made with `kubectl create
    secret`, with exactly the variables the config reads, as the docs, the base and the example say."""
    assert [o for o in rendered if o["kind"] == "Secret"] == []
    (container,) = one(rendered, "Deployment")["spec"]["template"]["spec"]["containers"]
    assert container["envFrom"] == [{"secretRef": {"name": NAME}}]
    assert "env" not in container
    variables = set(placeholders(config_text(rendered)))
    assert variables == {"BILLING_ACCESS_KEY_ID", "BILLING_SECRET_ACCESS_KEY", "INFERENCE_API_KEY"}
    for text in (
        DOCS.read_text(),
        (BASE / "kustomization.yaml").read_text(),
        (EXAMPLE / "kustomization.yaml").read_text(),
    ):
        command = re.search(
            r"kubectl create secret generic (\S+)(?:[^\n]*\\\n)*[^\n]*", text
        )  # with its \-continued lines
        assert command is not None
        assert command[1] == NAME
        assert set(re.findall(r"--from-literal=(\w+)=", command[0])) == variables


@pytest.mark.integration  # kubectl
def test_every_object_carries_the_recommended_labels(rendered: list[dict[str, Any]]) -> None:
    for resource in rendered:
        if resource["kind"] != "Namespace":
            assert SELECTOR.items() <= resource["metadata"].get("labels", {}).items(), resource["kind"]
    deployment = one(rendered, "Deployment")["spec"]
    assert deployment["selector"]["matchLabels"] == SELECTOR
    assert SELECTOR.items() <= deployment["template"]["metadata"]["labels"].items()
    assert one(rendered, "Service")["spec"]["selector"] == SELECTOR


@pytest.mark.integration  # kubectl
def test_the_image_is_set_by_the_overlay(base: list[dict[str, Any]], example: list[dict[str, Any]]) -> None:
    def image(objects: list[dict[str, Any]]) -> str:
        (container,) = one(objects, "Deployment")["spec"]["template"]["spec"]["containers"]
        return container["image"]

    assert image(base) == f"{NAME}:latest"
    (wanted,) = yaml.safe_load((EXAMPLE / "kustomization.yaml").read_text())["images"]
    assert wanted["name"] == NAME
    assert image(example) == f"{wanted['newName']}:{wanted['newTag']}"


@pytest.mark.integration  # kubectl
def test_the_commented_secret_generator_makes_the_secret_the_pod_reads(tmp_path: Path) -> None:
    """The example overlay says: to try it, uncomment the secretGenerator and write credentials.env."""
    tree = tmp_path / "kubernetes"
    shutil.copytree(KUBERNETES, tree)
    overlay = tree / "example" / "kustomization.yaml"
    lines = overlay.read_text().splitlines()
    start = lines.index("# secretGenerator:")
    uncommented = [line.removeprefix("# ") for line in lines[start:]]
    overlay.write_text("\n".join(lines[:start] + uncommented) + "\n")
    variables = placeholders((BASE / "config.yaml").read_text())
    (tree / "example" / "credentials.env").write_text("".join(f"{k}={v}\n" for k, v in variables.items()))
    objects = render(tree / "example")
    secret = one(objects, "Secret")
    (container,) = one(objects, "Deployment")["spec"]["template"]["spec"]["containers"]
    assert container["envFrom"] == [{"secretRef": {"name": secret["metadata"]["name"]}}]
    environment = {key: base64.b64decode(value).decode() for key, value in secret["data"].items()}
    assert environment == variables
    validate(yaml.safe_load(config_text(objects)), environment)
    assert schema_problems(objects) == []


@pytest.mark.integration  # kubectl
def test_your_own_config_replaces_the_shipped_one_from_a_component_listed_last(tmp_path: Path) -> None:
    """As docs/kubernetes.md says, with the example's components (the prometheusrule one included, which
    brings a config of its own): a component of yours, listed last, holding your config."""
    tree = tmp_path / "kubernetes"
    shutil.copytree(KUBERNETES, tree)
    blocks = re.findall(r"```yaml\n(.*?)```", DOCS.read_text(), re.DOTALL)
    component = next(block for block in blocks if block.startswith("# my-config/kustomization.yaml"))
    mine = tree / "example" / "my-config"
    mine.mkdir()
    (mine / "kustomization.yaml").write_text(component)
    shipped = (BASE / "config.yaml").read_text()
    own = shipped.replace("https://openapi.example.com", "https://mine.example.com")
    assert own != shipped
    (mine / "config.yaml").write_text(own)
    overlay = tree / "example" / "kustomization.yaml"
    listed = "  - ../components/networkpolicy\n"
    assert listed in overlay.read_text()
    overlay.write_text(overlay.read_text().replace(listed, listed + "  - my-config\n"))
    assert config_text(render(tree / "example")) == own


# --- the components -----------------------------------------------------------------------------


@pytest.mark.integration  # kubectl
def test_the_service_monitor_scrapes_the_service_and_kube_prometheus_stack_selects_it(
    example: list[dict[str, Any]],
) -> None:
    monitor, service = one(example, "ServiceMonitor"), one(example, "Service")
    assert RELEASE.items() <= monitor["metadata"]["labels"].items()
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert monitor["metadata"]["namespace"] == service["metadata"]["namespace"]  # no namespaceSelector needed
    assert "namespaceSelector" not in monitor["spec"]
    service_ports = {port["name"]: port for port in service["spec"]["ports"]}
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] in service_ports
    (container,) = one(example, "Deployment")["spec"]["template"]["spec"]["containers"]
    target = service_ports[endpoint["port"]]["targetPort"]
    assert target in {port["name"] for port in container["ports"]}
    assert endpoint.get("path", "/metrics") == "/metrics"


def rules_command() -> subprocess.CompletedProcess[str]:
    """`inference-cost-exporter rules --config config.example.yaml`, as a user runs it."""
    environment = os.environ | placeholders((ROOT / "config.example.yaml").read_text())
    return subprocess.run(
        [sys.executable, "-m", "exporter.cli", "rules", "--config", "config.example.yaml"],
        capture_output=True, text=True, timeout=60, cwd=ROOT, env=environment, check=True,
    )  # fmt: skip


def with_groups(committed: str, rules: str) -> str:
    """The PrometheusRule file: its head as committed, and `spec:` holding what `rules` wrote."""
    head, spec, _ = committed.partition("\nspec:\n")
    assert spec, "the PrometheusRule file has no `spec:` line"
    return head + spec + "".join(f"  {line}" if line.strip() else line for line in rules.splitlines(keepends=True))


@pytest.mark.integration  # kubectl, and the rules command as a process
def test_the_prometheus_rule_holds_what_the_rules_command_writes() -> None:
    result = rules_command()
    committed = PROMETHEUS_RULE.read_text()
    if os.environ.get("UPDATE_KUBERNETES"):
        PROMETHEUS_RULE.write_text(with_groups(committed, result.stdout))
        committed = PROMETHEUS_RULE.read_text()
    assert committed == with_groups(committed, result.stdout), "stale: rerun with UPDATE_KUBERNETES=1"
    rule = one(render(EXAMPLE), "PrometheusRule")  # rendered now: after the file is rewritten
    assert rule["spec"]["groups"] == yaml.safe_load(result.stdout)["groups"]
    assert RELEASE.items() <= rule["metadata"]["labels"].items()


@pytest.mark.integration  # kubectl
def test_each_alert_reaches_alertmanager_from_one_side_only(
    base: list[dict[str, Any]], example: list[dict[str, Any]]
) -> None:
    """The base: the exporter evaluates every rule and sends to Alertmanager. With the prometheusrule
    component, Prometheus evaluates what it can, the exporter keeps the rest: the same rules, each
    evaluated once."""
    alone = exporter_config(base)
    assert [n.type for n in alone.alerts.notifiers] == ["alertmanager"]
    rule = one(example, "PrometheusRule")
    text, skipped = rule_file(alone.alerts, alone.all_budgets)
    assert yaml.safe_load(text)["groups"] == rule["spec"]["groups"]  # the base's rules, as Prometheus evaluates them
    in_prometheus = {r["alert"] for group in rule["spec"]["groups"] for r in group["rules"]}
    split = exporter_config(example)
    in_exporter = {r.alert for r in split.alerts.rules}
    assert [n.type for n in split.alerts.notifiers] == ["alertmanager"]
    assert in_prometheus.isdisjoint(in_exporter)
    assert in_prometheus | in_exporter == {r.alert for r in alone.alerts.rules}
    assert len(skipped) == len(split.alerts.rules)  # the exporter keeps exactly what `rules` cannot write
    # ... and only the rules differ between the two configs.
    assert {k: v for k, v in yaml.safe_load(config_text(example)).items() if k != "alerts"} == {
        k: v for k, v in yaml.safe_load(config_text(base)).items() if k != "alerts"
    }
    assert split.alerts.notifiers == alone.alerts.notifiers


def allows(rules: list[dict[str, Any]], port: int, protocol: str = "TCP") -> list[dict[str, Any]]:
    """The NetworkPolicy rules that let `port` through."""
    return [
        rule
        for rule in rules
        if any(p["port"] == port and p.get("protocol", "TCP") == protocol for p in rule.get("ports", []))
    ]


@pytest.mark.integration  # kubectl
def test_the_network_policy_admits_prometheus_and_lets_the_exporter_reach_what_its_config_names(
    example: list[dict[str, Any]],
) -> None:
    policy = one(example, "NetworkPolicy")["spec"]
    assert policy["podSelector"]["matchLabels"] == SELECTOR
    assert sorted(policy["policyTypes"]) == ["Egress", "Ingress"]
    (container,) = one(example, "Deployment")["spec"]["template"]["spec"]["containers"]
    (ingress,) = policy["ingress"]
    assert ingress["ports"] == [{"port": container["ports"][0]["containerPort"], "protocol": "TCP"}]
    (source,) = ingress["from"]
    assert source["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name": "monitoring"}
    assert source["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "prometheus"}
    egress = policy["egress"]
    for protocol in ("UDP", "TCP"):
        assert any("to" not in rule for rule in allows(egress, 53, protocol)), f"DNS over {protocol}"
    config = exporter_config(example)
    destinations = [url_destination(str(config.billing.url)), url_destination(str(config.inference.url))]
    destinations += [d for notifier in config.alerts.notifiers for d in notifier_destinations(notifier)]
    for host, port in destinations:
        rules = allows(egress, port)
        assert rules, f"{host}:{port}"
        if any("to" in rule for rule in rules):  # a Service's DNS name: <service>.<namespace>
            namespace = host.split(".")[1]
            assert {"kubernetes.io/metadata.name": namespace} in [
                to["namespaceSelector"]["matchLabels"] for rule in rules for to in rule.get("to", [])
            ], f"{host}:{port}"
