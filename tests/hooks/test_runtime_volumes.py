"""A runtime's own volumes never collide with the mounts Noctaya renders into every serving Pod (#20,
item 6): the pydantic models refuse a collision with the CRD's messages (the real API server's side is
tests/kube/test_validation.py), the rendered Pods have unique volume names and mount paths for every
runtime the models accept, and a colliding runtime stored before the CRD refused it is reported as
Accepted=False VolumeConflict naming its volume."""

from __future__ import annotations

import copy
import posixpath
from pathlib import Path
from typing import Any

import pydantic
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hooks.api.runtime import (
    RESERVED_VOLUMES,
    SHM_MOUNT_PATH,
    InferenceRuntime,
    volume_conflicts,
)
from hooks.controller import runtime_status
from hooks.errors import describe_validation_error
from hooks.render import render_documents
from tests.hooks import helpers as h

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "runtimes"


def _runtime(volumes: list[dict[str, Any]], **spec: Any) -> dict[str, Any]:
    return h.runtime(volumes=volumes, **spec)


def _scratch(name: str, path: str) -> dict[str, Any]:
    return {"name": name, "mountPath": path, "emptyDir": True, "readOnly": False}


REFUSED = [
    ("shm", [_scratch("shm", "/dev/shm")], {}, "cannot mount at /dev/shm"),
    ("shm-trailing-slash", [_scratch("shm", "/dev/shm/")], {}, "cannot mount at /dev/shm"),
    ("root", [_scratch("root", "/")], {}, "cannot mount at the container's root directory"),
    ("backstep", [_scratch("up", "/dev/../dev/shm")], {}, "must be an absolute path without `..` segments"),
    ("cache-default", [_scratch("hf", "/cache")], {}, "cannot mount at cacheMountPath or modelMountPath"),
    ("model-default", [_scratch("w", "/models")], {}, "cannot mount at cacheMountPath or modelMountPath"),
    ("cache-custom", [_scratch("hf", "/root/.cache")], {"cacheMountPath": "/root/.cache/"},
     "cannot mount at cacheMountPath or modelMountPath"),
    ("reserved-name", [_scratch("dshm", "/scratch")], {}, "runtime volume names model-cache, model and dshm are Noctaya's own"),
    ("same-name", [_scratch("tmp", "/tmp"), _scratch("tmp", "/scratch")], {}, "runtime volume names must be unique"),
    ("same-path", [_scratch("a", "/tmp"), _scratch("b", "/tmp")], {}, "two runtime volumes cannot mount at the same path"),
    ("same-path-slash", [_scratch("a", "/tmp"), _scratch("b", "/tmp/")], {}, "two runtime volumes cannot mount at the same path"),
    ("cache-is-model", [], {"cacheMountPath": "/models/"}, "cacheMountPath, modelMountPath and /dev/shm must be three"),
    ("cache-is-shm", [], {"cacheMountPath": "/dev/shm"}, "cacheMountPath, modelMountPath and /dev/shm must be three"),
]


# Accepted by admission, as every earlier release accepted them (a stored runtime keeps working after
# an upgrade), but the container runtime cleans the path onto one of Noctaya's own mounts: the
# runtime's Accepted condition and every LLMService on it say VolumeConflict, naming the volume.
CLEANED_ONTO_NOCTAYAS = [
    ("shm-dot-segment", [_scratch("shm", "/dev/./shm")], {}),
    ("shm-double-slash", [_scratch("shm", "/dev//shm")], {}),
    ("cache-double-slash", [_scratch("hf", "/cache//")], {}),
]


@pytest.mark.parametrize(("volumes", "spec"), [c[1:] for c in CLEANED_ONTO_NOCTAYAS], ids=[c[0] for c in CLEANED_ONTO_NOCTAYAS])
def test_a_path_that_cleans_onto_noctayas_mounts_is_admitted_and_reported(volumes: list[dict[str, Any]],
                                                                           spec: dict[str, Any]) -> None:
    from hooks.api.llmservice import RuntimeRef
    from hooks.api.status import Reason
    from hooks.runtime.select import select_runtime

    runtime = _runtime(volumes, **spec)
    InferenceRuntime.model_validate(runtime)
    resolution = select_runtime(RuntimeRef.model_validate({"name": runtime["metadata"]["name"]}), [runtime])
    assert resolution.reason is Reason.VOLUME_CONFLICT and volumes[-1]["name"] in resolution.message


@pytest.mark.parametrize(("volumes", "spec", "message"), [c[1:] for c in REFUSED], ids=[c[0] for c in REFUSED])
def test_a_collision_with_noctayas_mounts_is_refused(volumes: list[dict[str, Any]], spec: dict[str, Any],
                                                     message: str) -> None:
    with pytest.raises(pydantic.ValidationError) as err:
        InferenceRuntime.model_validate(_runtime(volumes, **spec))
    assert message in describe_validation_error(err.value)  # what a condition says: words, never a regex


_COLLIDING = [c for c in REFUSED if c[0] not in ("root", "backstep")] + [(*c, "") for c in CLEANED_ONTO_NOCTAYAS]


@pytest.mark.parametrize(("volumes", "spec"), [c[1:3] for c in _COLLIDING], ids=[c[0] for c in _COLLIDING])
def test_a_stored_colliding_runtime_is_not_accepted_and_the_condition_names_the_volume(
        volumes: list[dict[str, Any]], spec: dict[str, Any]) -> None:
    parent = _runtime(volumes, **spec)
    out = runtime_status.sync({"controller": {}, "parent": parent, "children": {}, "related": {}, "finalizing": False},
                              h.config())
    (cond,) = out["status"]["conditions"]
    assert (cond["type"], cond["status"], cond["reason"]) == ("Accepted", "False", "VolumeConflict"), cond
    named = [v["name"] for v in volumes][-1:] or ["cacheMountPath"]
    assert named[0] in cond["message"], cond


@pytest.mark.parametrize(("path", "message"), [
    ("/x/../cache", "must be an absolute path without `..` segments"),  # the API server refuses it in a Pod
    ("cache", "must be an absolute path without `..` segments"),
    ("/", "cannot be the container's root directory"),
    ("/./", "cannot be the container's root directory"),
])
def test_noctayas_own_mount_paths_must_be_absolute_and_not_root(path: str, message: str) -> None:
    for field in ("cacheMountPath", "modelMountPath"):
        with pytest.raises(pydantic.ValidationError) as err:
            InferenceRuntime.model_validate(h.runtime(**{field: path}))
        assert message in describe_validation_error(err.value)


@pytest.mark.parametrize("path", ["/var/cache/engine/", "/.weights", "/cache//", "/./cache", "/opt/models/"])
def test_paths_earlier_releases_stored_are_still_accepted(path: str) -> None:
    """A runtime stored under an earlier release keeps working after an upgrade (docs/upgrading.md):
    trailing and doubled slashes and `.` segments mount where the container runtime cleans them to."""
    InferenceRuntime.model_validate(h.runtime(cacheMountPath=path, modelMountPath="/weights"))
    InferenceRuntime.model_validate(_runtime([_scratch("opt", path)]) if not path.startswith("/cache")
                                    else h.runtime(modelMountPath=path))


def test_the_condition_names_each_colliding_volume_and_what_noctaya_mounts_there() -> None:
    parent = _runtime([_scratch("vllm-shm", "/dev/shm"), _scratch("hub", "/cache"), _scratch("ok", "/tmp")])
    conflicts = volume_conflicts(parent["spec"])
    assert conflicts == ["runtime volume vllm-shm mounts at /dev/shm, where Noctaya mounts shared memory",
                         "runtime volume hub mounts at /cache, where Noctaya mounts the model cache (cacheMountPath)"]
    out = runtime_status.sync({"controller": {}, "parent": parent, "children": {}, "related": {}, "finalizing": False},
                              h.config())
    (cond,) = out["status"]["conditions"]
    assert cond["reason"] == "VolumeConflict"
    assert "vllm-shm" in cond["message"] and "hub" in cond["message"] and "ok" not in cond["message"].split()


def test_volume_conflicts_reads_any_stored_shape_without_raising() -> None:
    for junk in (None, [], {"volumes": "x"}, {"volumes": [1, None, {"name": 3}]}, {"cacheMountPath": 5, "volumes": [{}]}):
        assert isinstance(volume_conflicts(junk), list)
    assert volume_conflicts({"volumes": [{"name": "a", "mountPath": "/a"}, {"name": "a", "mountPath": "/a"}]}) == [
        "two runtime volumes are named a", "runtime volume a mounts at /a, as runtime volume a does"]


def test_a_runtime_without_collisions_is_accepted() -> None:
    parent = _runtime([_scratch("home", "/home/vllm"), _scratch("tmp", "/tmp"),
                       {"name": "cfg", "mountPath": "/etc/engine", "configMap": "engine-config"},
                       # beneath Noctaya's mounts is not a collision: the container runtime mounts parents first
                       _scratch("extra", "/cache/extra"), _scratch("shm-sub", "/dev/shm-not")])
    InferenceRuntime.model_validate(parent)
    assert volume_conflicts(parent["spec"]) == []
    out = runtime_status.sync({"controller": {}, "parent": parent, "children": {}, "related": {}, "finalizing": False},
                              h.config())
    assert out["status"]["conditions"][0]["reason"] == "Accepted"


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.yaml")), ids=lambda p: p.stem)
def test_every_example_runtime_is_free_of_collisions(path: Path) -> None:
    (doc,) = [d for d in yaml.safe_load_all(path.read_text()) if d and d.get("kind") == "InferenceRuntime"]
    InferenceRuntime.model_validate(doc)
    assert volume_conflicts(doc["spec"]) == []


def _backend_pods(runtime: dict[str, Any]) -> list[dict[str, Any]]:
    """The backend Pod spec for each model source kind and cache strategy."""
    out = []
    for source, cache in (("hf://org/model", {"strategy": "None"}),
                          ("hf://org/model", {"strategy": "SharedPVC", "size": "20Gi"}),
                          ("hf://org/model", {"strategy": "HostPath", "hostPath": "/var/lib/noctaya"}),
                          ("pvc://weights/llama", {"strategy": "None"})):
        service = h.llmservice(model={"source": source}, runtime={"name": runtime["metadata"]["name"]}, cache=cache)
        for obj in render_documents([copy.deepcopy(runtime), service]):
            if obj["kind"] == "Deployment" and obj["metadata"]["name"].endswith("-backend"):
                out.append(obj["spec"]["template"]["spec"])
    assert len(out) == 4
    return out


def test_the_reserved_list_is_what_the_pod_renderer_mounts() -> None:
    """Every volume and mount Noctaya adds to a serving Pod is in RESERVED_VOLUMES / the reserved paths,
    so a new Noctaya mount cannot be added to hooks/runtime/pod.py without the admission rules knowing."""
    runtime = h.runtime(cacheMountPath="/var/cache/engine", modelMountPath="/weights")
    spec = InferenceRuntime.model_validate(runtime).spec
    names: set[str] = set()
    paths: set[str] = set()
    for pod in _backend_pods(runtime):
        names |= {v["name"] for v in pod["volumes"]}
        for c in pod["containers"] + pod.get("initContainers", []):
            paths |= {m["mountPath"] for m in c.get("volumeMounts", [])}
    assert names <= set(RESERVED_VOLUMES), names - set(RESERVED_VOLUMES)
    assert paths <= {SHM_MOUNT_PATH, spec.cache_mount_path, spec.model_mount_path}, paths


_segment = st.sampled_from(["dev", "shm", "cache", "models", "tmp", "home", "x", ".triton", "..a"])
_path = st.lists(_segment, min_size=1, max_size=3).map(lambda parts: "/" + "/".join(parts))
_volume = st.builds(lambda name, path: _scratch(name, path),
                    st.sampled_from(["a", "b", "tmp", "model", "dshm", "model-cache", "home"]), _path)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(volumes=st.lists(_volume, max_size=4),
       cache=st.sampled_from(["/cache", "/cache/", "/cache//", "/./cache", "/models", "/dev/shm", "/dev/shm/", "/home"]),
       model=st.sampled_from(["/models", "/models/", "/cache", "/tmp"]))
def test_an_accepted_runtime_renders_pods_with_unique_volumes_and_mounts(volumes: list[dict[str, Any]], cache: str,
                                                                         model: str) -> None:
    """What the API server would refuse in a Deployment (a duplicate volume name or mount path in one
    container, or two paths the container runtime cleans to one) never follows from a runtime the hooks
    use: the models accept it and volume_conflicts names nothing (select_runtime refuses it otherwise,
    as VolumeConflict). The models refuse the plainly written collisions at admission already (the CEL
    rules are the same checks: tests/hooks/test_crdgen.py and tests/kube/test_validation.py)."""
    runtime = _runtime(volumes, cacheMountPath=cache, modelMountPath=model)
    try:
        InferenceRuntime.model_validate(runtime)
    except pydantic.ValidationError:
        return
    if volume_conflicts(runtime["spec"]):
        return
    for pod in _backend_pods(runtime):
        names = [v["name"] for v in pod["volumes"]]
        assert len(names) == len(set(names)), names
        for c in pod["containers"] + pod.get("initContainers", []):
            mounts = [posixpath.normpath(m["mountPath"]) for m in c.get("volumeMounts", [])]
            assert len(mounts) == len(set(mounts)), mounts


def _under(path: str, mount: str) -> bool:
    return path == mount or path.startswith(mount.rstrip("/") + "/")


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.yaml")), ids=lambda p: p.stem)
def test_a_non_root_example_engine_has_somewhere_to_write(path: Path) -> None:
    """#20 item 12: an engine image built for root, run as another uid, finds HOME, its XDG caches and
    /tmp writable and a USER for getpass.getuser(); the hub caches stay on Noctaya's cache volume."""
    (doc,) = [d for d in yaml.safe_load_all(path.read_text()) if d and d.get("kind") == "InferenceRuntime"]
    if not doc["spec"].get("security", {}).get("runAsUser"):
        pytest.skip("runs as the image's user (docs/install.md says why)")
    if doc["spec"]["engine"] == "llamacpp":
        pytest.skip("llama-server writes only to LLAMA_CACHE on the cache volume")
    for pod in _backend_pods(doc):
        (engine,) = pod["containers"]
        env = {e["name"]: e.get("value") for e in engine["env"]}
        writable = [m["mountPath"] for m in engine["volumeMounts"] if not m.get("readOnly")]
        assert env.get("USER"), env
        for var in ("HOME", "XDG_CACHE_HOME", "XDG_CONFIG_HOME", "HF_HOME"):
            assert any(_under(env[var], m) for m in writable), (var, env[var], writable)
        assert any(_under("/tmp", m) for m in writable), writable
        assert env["HF_HOME"].endswith("/huggingface") and not _under(env["HF_HOME"], env["HOME"])
        assert pod["securityContext"]["fsGroup"] == doc["spec"]["security"]["runAsUser"]


def test_an_llmservice_names_the_colliding_volume_of_its_runtime() -> None:
    # A runtime stored before the admission rules existed: the LLMService says which volume, and a
    # selector skips the runtime instead of rendering a backend the API server would refuse.
    from hooks.api.llmservice import RuntimeRef
    from hooks.api.status import Reason
    from hooks.runtime.select import select_runtime

    runtime = {"apiVersion": "serving.noctaya.io/v1alpha1", "kind": "InferenceRuntime",
               "metadata": {"name": "vllm", "labels": {"engine": "vllm"}},
               "spec": {"engine": "vllm", "image": "vllm/vllm-openai:v0.8.5",
                        "volumes": [{"name": "vllm-shm", "mountPath": "/dev/shm", "emptyDir": {}}]}}
    by_name = select_runtime(RuntimeRef.model_validate({"name": "vllm"}), [runtime])
    assert by_name.reason is Reason.VOLUME_CONFLICT and not by_name.resolved
    assert "vllm-shm" in by_name.message and "/dev/shm" in by_name.message
    by_label = select_runtime(RuntimeRef.model_validate({"selector": {"matchLabels": {"engine": "vllm"}}}), [runtime])
    assert by_label.reason is Reason.RUNTIME_NOT_FOUND and "skipped invalid: vllm" in by_label.message
