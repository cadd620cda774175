"""LLMService: the model's intent — what to serve, on which runtime, how to scale and expose it."""

from __future__ import annotations

import math
import re
from typing import ClassVar, Literal

from pydantic import Field, model_validator

from hooks.api import cron
from hooks.api.common import (
    ABSOLUTE_PATH_RE,
    API_VERSION,
    ApiModel,
    CRDInfo,
    DNSLabel,
    DNSSubdomain,
    Duration,
    EnvVar,
    LabelSelector,
    LocalObjectReference,
    ObjectMeta,
    PrinterColumn,
    Quantity,
    ResourceRequirements,
    Rule,
    SecretKeyRef,
    duration_seconds,
)
from hooks.api.status import LLMServiceStatus
from hooks.api.upgrades import TIME_ZONE_RE, Upgrades, check_window_expressions, cron_window_rules
from hooks.errors import explain_pattern
from prewarm import sources

# The grammar of model.source and model.revision lives in one module (prewarm.sources): the CEL
# rules below are generated from it, the models parse with it, and the prewarm Job's cache layout
# uses the same parse.
_HUB_SOURCE_RE = sources.HUB_SOURCE_RE
_OCI_SOURCE_RE = sources.OCI_SOURCE_RE
_PVC_SOURCE_RE = sources.PVC_SOURCE_RE
MODEL_SOURCE_RE = "|".join(f"({r})" for r in (_HUB_SOURCE_RE, _OCI_SOURCE_RE, _PVC_SOURCE_RE))
# The schema pattern only checks the scheme; one rule per scheme then says exactly what is wrong
# (an OpenAPI pattern failure would show the user this whole regex).
_SCHEME_RE = explain_pattern(sources.SCHEME_RE, "a source starting with hf://, modelscope://, oci:// or pvc://")
ModelSource = sources.ModelSource
parse_model_source = sources.parse_model_source


def _cel_string(regex: str) -> str:
    """A regex as a single-quoted CEL string literal."""
    return "'" + regex.replace("\\", "\\\\").replace("'", "\\'") + "'"


class ModelSpec(ApiModel):
    """Which model to serve and where its weights come from."""

    source: str = Field(
        description="Where the weights come from: hf://org/name (Hugging Face), modelscope://org/name, "
        "oci://registry/repo@sha256:<digest> (an OCI artifact; digest pinning is mandatory), or "
        "pvc://claim/sub/path (pre-staged weights, mounted read-only at the runtime's modelMountPath).",
        pattern=_SCHEME_RE,
        max_length=sources.SOURCE_MAX,
    )
    revision: str | None = Field(
        default=None,
        description="Hub revision (branch, tag or commit) for hf:// and modelscope:// sources.",
        pattern=sources.REVISION_RE,
        max_length=sources.REVISION_MAX,
    )
    served_name: str | None = Field(
        default=None,
        description="Model name clients send in requests; defaults to the LLMService name.",
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._:/-]*$",
        max_length=256,
    )
    credentials_secret: SecretKeyRef | None = Field(
        default=None,
        description="Secret with the hub token (key defaults to token) or, for oci://, a "
        "kubernetes.io/dockerconfigjson Secret (key defaults to .dockerconfigjson). Only the Job that stages the "
        "weights gets it (and, without cache.prewarm, a hub model's engine). Its data never appears in status, "
        "logs or args.",
    )

    rules: ClassVar[tuple[Rule, ...]] = (
        Rule(
            cel="!(self.source.startsWith('hf://') || self.source.startsWith('modelscope://')) || "
            f"self.source.matches({_cel_string(_HUB_SOURCE_RE)})",
            message=sources.HUB_MESSAGE,
            check=lambda s: not s.source.startswith(("hf://", "modelscope://"))
            or re.fullmatch(_HUB_SOURCE_RE, s.source) is not None,
        ),
        Rule(
            cel=f"!self.source.startsWith('oci://') || self.source.matches({_cel_string(_OCI_SOURCE_RE)})",
            message=sources.OCI_MESSAGE,
            check=lambda s: not s.source.startswith("oci://") or re.fullmatch(_OCI_SOURCE_RE, s.source) is not None,
        ),
        Rule(
            cel=f"!self.source.startsWith('pvc://') || self.source.matches({_cel_string(_PVC_SOURCE_RE)})",
            message=sources.PVC_MESSAGE,
            check=lambda s: not s.source.startswith("pvc://") or re.fullmatch(_PVC_SOURCE_RE, s.source) is not None,
        ),
        Rule(
            cel="!has(self.revision) || self.source.startsWith('hf://') || self.source.startsWith('modelscope://')",
            message="revision applies only to hf:// and modelscope:// sources (oci:// pins a digest)",
            check=lambda s: s.revision is None or s.source.startswith(("hf://", "modelscope://")),
        ),
    )

    @property
    def parsed(self) -> ModelSource:
        return parse_model_source(self.source)


class RuntimeRef(ApiModel):
    """Which InferenceRuntime runs this model: by name, or the highest-priority match of a selector."""

    name: DNSLabel | None = Field(default=None, description="Name of the InferenceRuntime to use.")
    selector: LabelSelector | None = Field(
        default=None,
        description="Label selector over InferenceRuntimes; the highest spec.priority wins, a tie is "
        "reported as AmbiguousRuntime.",
    )
    args: list[str] = Field(default_factory=list, description="Args appended to the runtime's args.")
    env: list[EnvVar] = Field(
        default_factory=list, max_length=128, description="Env appended to (and overriding) the runtime's env."
    )

    rules: ClassVar[tuple[Rule, ...]] = (
        Rule(
            cel="has(self.name) != has(self.selector)",
            message="set exactly one of runtime.name or runtime.selector",
            check=lambda s: (s.name is None) != (s.selector is None),
        ),
    )


class BackendResources(ApiModel):
    """Resources of one backend (serving) Pod."""

    accelerators: int = Field(
        default=1, ge=0, le=64, description="Accelerators per replica (0 for CPU-only runtimes)."
    )
    cpu: Quantity | None = Field(default=None, description="CPU request of the serving container, e.g. 4.")
    memory: Quantity | None = Field(default=None, description="Memory request and limit of the serving container.")
    limits: dict[str, Quantity] = Field(
        default_factory=dict, description="Extra limits for the serving container (e.g. ephemeral-storage)."
    )


LeadingSignal = Literal["InFlightRatio", "KVCacheUsage", "WaitingRequests"]


class LeadingSignalTrigger(ApiModel):
    """A Prometheus trigger OR-combined with gateway demand for 1→N scale-out.

    The query tracks the hottest replica (max over pods, not the mean) using the gauge names from the
    runtime's metrics metadata.
    """

    signal: LeadingSignal = Field(
        description="InFlightRatio (engine in-flight ÷ maxConcurrentSequences), KVCacheUsage (0..1) or "
        "WaitingRequests (requests queued inside the engine)."
    )
    threshold: str = Field(
        description="Per-replica target value, as a decimal string (e.g. \"0.8\" or \"4\").",
        pattern=r"^[0-9]+(\.[0-9]+)?$",
    )
    server_address: str = Field(
        description="Prometheus-compatible query URL, e.g. http://prometheus.monitoring.svc:9090.",
        pattern=r"^https?://",
    )
    max_concurrent_sequences: int | None = Field(
        default=None,
        ge=1,
        description="The engine's maximum concurrent sequences (vLLM --max-num-seqs); InFlightRatio divides by it.",
    )
    query: str | None = Field(default=None, description="Override the generated PromQL query.")

    rules: ClassVar[tuple[Rule, ...]] = (
        Rule(
            cel="self.signal != 'InFlightRatio' || has(self.maxConcurrentSequences) || has(self.query)",
            message="InFlightRatio needs maxConcurrentSequences (or an explicit query)",
            check=lambda s: s.signal != "InFlightRatio" or s.max_concurrent_sequences is not None or s.query is not None,
        ),
    )


_LEAD_TIME_RE = explain_pattern(r"^(auto|([0-9]+(\.[0-9]+)?(ms|s|m|h))+)$", "auto or a duration such as 15m")
_TIME_ZONE_RE = TIME_ZONE_RE
MAX_LEAD_SECONDS = 3600


def lead_minutes(seconds: float) -> int:
    """A lead time in whole minutes (cron's resolution), rounded up: never opens late."""
    return min(math.ceil(seconds / 60), MAX_LEAD_SECONDS // 60)


class WarmWindow(ApiModel):
    """A time window in which the backend is held at `replicas` whether or not requests come.

    Rendered as a KEDA cron trigger beside the demand trigger: KEDA takes the larger, so demand
    still scales past the window's floor, and outside windows the model scales to zero as usual.
    """

    start: str = Field(description="When the window opens: a 5-field cron expression (minute hour "
                       "day-of-month month day-of-week), e.g. \"0 8 * * MON-FRI\".", max_length=100)
    end: str = Field(description="When it closes, the same way, e.g. \"0 18 * * MON-FRI\".", max_length=100)
    time_zone: str = Field(default="UTC", description="IANA time zone both expressions are read in, "
                           "e.g. Europe/Berlin.", max_length=64, pattern=_TIME_ZONE_RE)
    replicas: int = Field(default=1, ge=1, le=1000, description="Backend replicas held during the window.")
    lead_time: str | None = Field(
        default=None, max_length=32, pattern=_LEAD_TIME_RE,
        description="Open this much before `start` (up to 1h, in whole minutes), so the model is Ready when "
        "the window opens; `auto` uses the last measured cold start (status.lastColdStart.total, "
        "none until one was measured). Needs a start with one minute and explicit hours.",
    )

    rules: ClassVar[tuple[Rule, ...]] = (
        *cron_window_rules("schedules", "0 8 * * MON-FRI", "0 18 * * MON-FRI"),
        Rule(
            cel="!has(self.leadTime) || self.leadTime == 'auto' || duration(self.leadTime) <= duration('1h')",
            message="schedules[].leadTime must be auto or a duration up to 1h",
            check=lambda w: w.lead_time in (None, "auto") or duration_seconds(w.lead_time) <= MAX_LEAD_SECONDS,
        ),
    )

    @model_validator(mode="after")
    def _check_beyond_cel(self) -> WarmWindow:
        """What CEL cannot say: the time zone database, backwards ranges, and whether a lead time
        can be written as one earlier cron expression. The hooks then report the spec invalid."""
        check_window_expressions("schedules", self.start, self.end, self.time_zone)
        if self.lead_time is not None:
            leads = range(1, MAX_LEAD_SECONDS // 60 + 1) if self.lead_time == "auto" else [self.lead(None)]
            if any(cron.shift_earlier(self.start, m) is None for m in leads):
                raise ValueError(
                    f"schedules[].leadTime {self.lead_time} cannot move start {self.start!r} earlier as one cron "
                    "expression: give start one minute and explicit hours (and keep day of month and month * "
                    "if the lead can cross midnight), or write the earlier start yourself")
        # KEDA's rule (active while the next end comes before the next start) opens a window exactly
        # from start − lead to end only when starts and ends take turns, the lead stays short of the
        # previous end, and no start, early start or end falls in a clock change (hooks.api.cron).
        year = cron.this_year()
        turns = cron.pairing(self.start, self.end, year)
        if turns.problem is not None:
            raise ValueError(f"schedules[]: {turns.problem}")
        fixed = 0 if self.lead_time in (None, "auto") else self.lead(None)
        if fixed >= turns.gap:
            raise ValueError(
                f"schedules[].leadTime {self.lead_time} would open the window before the previous one has ended "
                f"(end {self.end!r} comes {turns.gap}m before start {self.start!r}); give a leadTime under "
                f"{turns.gap}m")
        clash = cron.clock_change_clash(self.start, self.end, self.time_zone, fixed, year)
        if clash is not None:
            safe = cron.max_safe_lead(self.start, self.time_zone, fixed, year) if fixed else None
            if safe is not None and cron.clock_change_clash(self.start, self.end, self.time_zone, safe, year) is None:
                fix = f"a leadTime of at most {safe}m avoids it"
            else:
                fix = "no lead avoids it: move start and end out of the times the clock change skips or repeats"
            raise ValueError(f"schedules[]: {clash}; {fix}")
        return self

    def lead(self, measured: float | None) -> int:
        """Minutes by which this window opens early; `auto` uses the measured cold start (seconds),
        shortened when needed (see `auto_cap`)."""
        if self.lead_time is None:
            return 0
        if self.lead_time == "auto":
            wanted = lead_minutes(measured) if measured else 0
            return min(wanted, self.auto_cap()[0])
        return lead_minutes(duration_seconds(self.lead_time))

    def auto_cap(self) -> tuple[int, str]:
        """The longest `auto` lead (minutes) KEDA reads as written, and why it is not longer: it stays
        short of the previous end and keeps every early start clear of the time zone's clock changes."""
        year = cron.this_year()
        limit = MAX_LEAD_SECONDS // 60
        gap = cron.pairing(self.start, self.end, year).gap
        cap, why = limit, ""
        if gap - 1 < cap:
            cap, why = gap - 1, f"end {self.end!r} comes {gap}m before start"
        safe = cron.max_safe_lead(self.start, self.time_zone, cap, year)
        if safe is not None and safe < cap:
            clash = cron.clock_change_clash(self.start, self.end, self.time_zone, safe + 1, year) or ""
            cap, why = safe, f"a longer lead would cross a clock change: {clash.split(': ', 1)[-1].split(';')[0]}"
        return cap, why


class Scaling(ApiModel):
    """Replica bounds and timings. KEDA owns backend replicas; these are its inputs."""

    min: int = Field(default=0, ge=0, le=1000, description="Minimum backend replicas; 0 releases accelerators when idle.")
    max: int = Field(default=1, ge=1, le=1000, description="Maximum backend replicas.")
    target_per_replica: int = Field(
        default=10, ge=1, description="Gateway demand (queued + in-flight requests) one replica should carry."
    )
    activation_timeout: Duration = Field(
        default="5m",
        description="How long a cold request keeps the backend waking before it gets activation_timeout.",
    )
    cooldown_period: Duration = Field(
        default="5m", description="Idle time before scaling back to min (KEDA cooldownPeriod and HPA scale-down window)."
    )
    polling_interval: Duration = Field(default="5s", description="How often KEDA polls the scaler.")
    yield_policy: Literal["WhenIdle", "Never"] = Field(
        default="WhenIdle",
        description="Whether this model, while idle, may give its accelerators to a cold model through an "
        "AcceleratorPool. WhenIdle: when a pool lists this model as yielding, its ScaledObject gets the pool's short "
        "cooldownPeriod, so KEDA scales it in once it has been idle for the pool's yieldAfter (KEDA asks the "
        "gateway right before, so a busy model is never scaled in). Never: no pool ever picks it. A model with "
        "scaling.min >= 1, or inside an open warm window, is never picked either way.",
    )
    triggers: list[LeadingSignalTrigger] = Field(
        default_factory=list, max_length=8, description="Leading-signal triggers for 1→N, OR-combined with demand."
    )
    schedules: list[WarmWindow] = Field(
        default_factory=list, max_length=8,
        description="Warm windows: cron-scheduled times the backend is held at a floor of replicas (KEDA cron "
        "triggers beside the demand trigger, which still scales past the floor).",
    )

    rules: ClassVar[tuple[Rule, ...]] = (
        Rule(
            cel="self.min <= self.max",
            message="scaling.min must not exceed scaling.max",
            check=lambda s: s.min <= s.max,
        ),
        Rule(
            cel="duration(self.activationTimeout) >= duration('1s') && duration(self.activationTimeout) <= duration('1h')",
            message="scaling.activationTimeout must be between 1s and 1h",
            check=lambda s: 1 <= duration_seconds(s.activation_timeout) <= 3600,
        ),
        Rule(
            cel="!has(self.schedules) || self.schedules.all(w, !has(w.replicas) || w.replicas <= self.max)",
            message="scaling.schedules[].replicas must not exceed scaling.max",
            check=lambda s: all(w.replicas <= s.max for w in s.schedules),
        ),
        Rule(
            cel="duration(self.pollingInterval) >= duration('1s')",
            message="scaling.pollingInterval must be at least 1s",
            check=lambda s: duration_seconds(s.polling_interval) >= 1,
        ),
    )


CacheStrategy = Literal["NodeLocalPVC", "SharedPVC", "HostPath", "None", "BakedImage"]


class Cache(ApiModel):
    """Where downloaded weights are kept between cold starts."""

    strategy: CacheStrategy = Field(
        default="NodeLocalPVC",
        description="NodeLocalPVC (RWO claim on a node-local class; one node's cache, so with scaling.max > 1 the "
        "extra replicas must fit on that node), SharedPVC (one RWX claim shared by replicas on any node), "
        "HostPath, None (download into an emptyDir every start), or BakedImage (reserved, not implemented).",
    )
    size: Quantity = Field(default="50Gi", description="Size of the cache claim.")
    storage_class_name: str | None = Field(default=None, description="StorageClass of the cache claim.")
    host_path: str | None = Field(default=None, description="Node directory for the HostPath strategy.", pattern=ABSOLUTE_PATH_RE)
    prewarm: bool = Field(
        default=False,
        description="hf:// and modelscope:// only: a Job (no accelerator) downloads model.revision into the cache, "
        "verifies every file and promotes it atomically before the backend is created; serving Pods wait for its "
        "marker, load the weights offline without the hub token, and mount a SharedPVC read-only.",
    )

    rules: ClassVar[tuple[Rule, ...]] = (
        Rule(
            cel="(self.strategy == 'HostPath') == has(self.hostPath)",
            message="cache.hostPath is required with strategy HostPath and not allowed otherwise",
            check=lambda s: (s.strategy == "HostPath") == (s.host_path is not None),
        ),
        Rule(
            cel="!self.prewarm || self.strategy in ['NodeLocalPVC', 'SharedPVC', 'HostPath']",
            message="cache.prewarm needs a persistent cache (NodeLocalPVC, SharedPVC or HostPath)",
            check=lambda s: not s.prewarm or s.strategy in ("NodeLocalPVC", "SharedPVC", "HostPath"),
        ),
    )


class EndpointAuth(ApiModel):
    """Client API-key authentication at the gateway."""

    secret_ref: SecretKeyRef = Field(
        description="Secret key holding the API key clients send as a Bearer token (key defaults to api-key). "
        "Reread on every request, so rotating the Secret needs no restart."
    )


class EndpointService(ApiModel):
    """The public gateway Service."""

    type: Literal["ClusterIP", "NodePort", "LoadBalancer"] = Field(default="ClusterIP", description="Service type.")
    annotations: dict[str, str] = Field(default_factory=dict, description="Annotations of the public Service.")


# Which endpoint fields a member of a shared gateway (endpoint.gateway) uses: the Pod-wide ones
# belong to the LLMGateway, the admission ones stay with each model.
_SHARED = "Not used with endpoint.gateway set (the LLMGateway's own setting applies)."
_PER_MODEL = "Per model: with endpoint.gateway set it still applies to this model."
# The gateway's own default of coldBatchPerPod (gateway.config.GatewayConfig.pod_batch), said in the
# description; unset renders nothing, so the gateway's default applies.
DEFAULT_COLD_BATCH_PER_POD = 8


class Balancing(ApiModel):
    """How the gateway spreads this model's requests over its backend Pods. Both fields are optional
    and have no schema default (unset means the gateway's own default), so setting neither renders
    exactly what an LLMService without `balancing` renders."""

    prefix_affinity: bool | None = Field(
        default=None,
        description="Unset or true: a request that carries OpenAI's prompt_cache_key, or whose prompt begins "
        "like an earlier one, goes to the backend Pod that served that key or beginning before (where the "
        "engine's prefix cache likely still holds it), unless that Pod already has clearly more outstanding "
        "requests than the others (a load bound); false: every request goes to the Pod with the fewest "
        "outstanding requests. " + _PER_MODEL,
    )
    cold_batch_per_pod: int | None = Field(
        default=None,
        ge=1,
        le=1024,
        description="While other backend Pods of the model are still starting, a held (cold) request goes to a Pod "
        "that is ready only while that Pod has fewer than this many outstanding requests; the others wait for the "
        "next Pod to turn ready or a request to finish. Unset: the gateway's default, "
        f"{DEFAULT_COLD_BATCH_PER_POD}. " + _PER_MODEL,
    )


class Endpoint(ApiModel):
    """The always-on OpenAI-compatible gateway in front of the backend."""

    replicas: int = Field(
        default=1,
        ge=1,
        le=32,
        description="Gateway replicas; more than one adds an aggregate scaler and a PDB. With endpoint.gateway "
        "set it must be 1 (the LLMGateway's replicas serve the model).",
    )
    max_queue: int = Field(
        default=100,
        ge=1,
        le=10000,
        description="Per-gateway bound on waiting plus in-flight requests; beyond it, 429. " + _PER_MODEL,
    )
    cold_request_mode: Literal["keepalive", "reject"] = Field(
        default="keepalive",
        description="keepalive holds cold requests (SSE heartbeats for streams) until the backend is Ready; "
        "reject answers 503 with Retry-After while the backend still wakes. " + _PER_MODEL,
    )
    retry_after_seconds: int = Field(
        default=10, ge=1, le=3600, description="Retry-After of reject-mode 503s. " + _PER_MODEL
    )
    max_connections_per_address: int | None = Field(
        default=None,
        ge=0,
        description="Open client connections one source address may hold on each gateway worker process; "
        "beyond it that address's oldest idle connection is closed to make room, or, when none is idle, the new "
        "connection gets 429 too_many_connections and is closed. Unset: 64 (at most an eighth of the worker's "
        "pool of 4096); 0: no cap. Idle connections never lock anyone out (a full pool closes its oldest idle "
        "one). Behind an ingress controller, a mesh sidecar or source NAT (e.g. a LoadBalancer Service with "
        "externalTrafficPolicy Cluster) many or all clients reach the gateway from one address: set 0 there, or "
        "a number above what that hop opens. " + _SHARED,
    )
    request_timeout_seconds: int | None = Field(
        default=None,
        ge=1,
        le=3600,
        description="Seconds a client has to send a request's head (from its first byte); beyond it the client "
        "gets 408 request_timeout and the connection is closed. Unset: 60. A body has no fixed deadline: after "
        "10 s it must keep arriving at 8 KiB/s or more (averaged over 10 s), else 408 client_too_slow, and "
        "take at most 1800 s (the gateway's NOCTAYA_CLIENT_* settings). " + _SHARED,
    )
    auth: EndpointAuth | None = Field(
        default=None,
        description="Optional client API-key authentication. Refused with endpoint.gateway set (the LLMGateway "
        "carries the API keys).",
    )
    gateway: DNSLabel | None = Field(
        default=None,
        description="Name of an LLMGateway in this namespace that fronts this model beside others (one base URL for "
        "many models). Set: this LLMService renders no gateway, public Service, scaler Service, aggregate scaler, PDB "
        "or scaler token of its own; its ScaledObject asks the LLMGateway's scaler for this model's demand (by its "
        "served name), and status.endpoint is the LLMGateway's URL. replicas, resources, service, "
        "maxConnectionsPerAddress and requestTimeoutSeconds are then the LLMGateway's and not used here; auth and "
        "scalerTLS are refused and replicas must be 1. maxQueue, coldRequestMode, retryAfterSeconds, balancing and the "
        "scaling timings stay per model. Unset: this LLMService gets its own gateway Deployment and Service (the default).",
    )
    resources: ResourceRequirements | None = Field(
        default=None,
        description="Gateway container resources (defaults: 50m CPU, 64Mi request; 512Mi limit). " + _SHARED,
    )
    service: EndpointService = Field(
        default_factory=EndpointService, description="Public Service type and annotations. " + _SHARED
    )
    # No schema default (docs/upgrading.md, "New fields"): absent means the gateway's defaults.
    balancing: Balancing | None = Field(
        default=None,
        description="How the gateway balances this model's requests over its backend Pods (it watches their "
        "EndpointSlices and balances per Pod where the install lets it, docs/install.md; else it reaches the "
        "backend through its Service). Unset: prefix affinity on, cold batch 8. " + _PER_MODEL,
    )

    rules: ClassVar[tuple[Rule, ...]] = (
        Rule(
            cel="!has(self.gateway) || !has(self.auth)",
            message="endpoint.auth is not allowed with endpoint.gateway: the LLMGateway carries the API keys",
            check=lambda s: s.gateway is None or s.auth is None,
        ),
        Rule(
            cel="!has(self.gateway) || !has(self.replicas) || self.replicas == 1",
            message="endpoint.replicas must be 1 with endpoint.gateway: the LLMGateway's replicas serve this model",
            check=lambda s: s.gateway is None or s.replicas == 1,
        ),
    )


class ScalerTLS(ApiModel):
    """Mutual TLS between KEDA and the scaler, from credentials that already exist in the namespace."""

    secret_name: DNSLabel = Field(
        description="kubernetes.io/tls Secret with tls.crt, tls.key and ca.crt (the CA that signs KEDA's client cert). "
        "With endpoint.replicas > 1 the gateways also verify the aggregate scaler's tls.crt with this ca.crt (their "
        "demand reports go over HTTPS), so it must be the CA that signed tls.crt as well; the aggregate scaler "
        "checks this at startup."
    )
    trigger_authentication: DNSLabel = Field(
        description="KEDA TriggerAuthentication (or ClusterTriggerAuthentication, see triggerAuthenticationKind) "
        "carrying caCert, tlsClientCert and tlsClientKey for KEDA's side."
    )
    trigger_authentication_kind: Literal["TriggerAuthentication", "ClusterTriggerAuthentication"] = Field(
        default="TriggerAuthentication",
        description="ClusterTriggerAuthentication lets one KEDA client certificate, kept in KEDA's own namespace, serve "
        "every namespace.",
    )


class Scheduling(ApiModel):
    """Scheduling of this model's backend Pods, over the runtime's `scheduling`."""

    priority_class_name: DNSSubdomain | None = Field(
        default=None,
        description="PriorityClass of the backend Pods; overrides the runtime's scheduling.priorityClassName. "
        "Caveats: a higher priority lets the scheduler preempt lower-priority Pods whether they are busy or idle "
        "(their in-flight requests only survive through the drain), equal priorities never preempt each other, "
        "and a Pod's priority is fixed when it is created (a change rolls the backend). To let idle models give "
        "accelerators to cold ones, use an AcceleratorPool (scaling.yieldPolicy) instead.",
    )


class LLMServiceSpec(ApiModel):
    """Desired state of one served model."""

    model: ModelSpec = Field(description="The model and where its weights come from.")
    runtime: RuntimeRef = Field(description="The InferenceRuntime that runs the model.")
    resources: BackendResources = Field(default_factory=BackendResources, description="Backend Pod resources.")
    scaling: Scaling = Field(default_factory=Scaling, description="Replica bounds, activation and cooldown timings.")
    scheduling: Scheduling | None = Field(
        default=None,
        description="Scheduling of this model's backend Pods; what is set here overrides the runtime's scheduling.",
    )
    cache: Cache = Field(default_factory=Cache, description="Model cache and prewarm.")
    endpoint: Endpoint = Field(default_factory=Endpoint, description="The gateway: admission, cold mode, auth, Service.")
    scaler_tls: ScalerTLS | None = Field(default=None, alias="scalerTLS", description="Mutual TLS for KEDA ↔ scaler, and TLS for gateway → aggregate scaler reports. Not supported with endpoint.gateway set (refused).")
    image_pull_secrets: list[LocalObjectReference] = Field(
        default_factory=list,
        max_length=16,
        description="Registry credentials (kubernetes.io/dockerconfigjson Secrets in this namespace) for every Pod "
        "rendered for this LLMService: backend, gateways, aggregate scaler; added to the runtime's own.",
    )
    # No schema default (absent means the defaults of Upgrades): while an upgrade rolls, the previous
    # release's hook server reads every stored object, and a field the API server filled in would be
    # unknown to it (docs/upgrading.md, "New fields").
    upgrades: Upgrades | None = Field(
        default=None,
        description="How Noctaya's own changes (a new release, an install setting) reach this model's running "
        "Pods without reloading it while it is warm (absent: policy WhenIdle, no windows). Changes to this "
        "LLMService or its runtime roll at once.",
    )

    rules: ClassVar[tuple[Rule, ...]] = (
        Rule(
            cel="!self.model.source.startsWith('pvc://') || !self.cache.prewarm",
            message="a pvc:// source is pre-staged: cache.prewarm does not apply",
            check=lambda s: not s.model.source.startswith("pvc://") or not s.cache.prewarm,
        ),
        Rule(
            # The shared scaler (one per LLMGateway) has no per-model TLS credentials yet.
            cel="!has(self.endpoint.gateway) || !has(self.scalerTLS)",
            message="scalerTLS is not supported with endpoint.gateway yet",
            check=lambda s: s.endpoint.gateway is None or s.scaler_tls is None,
        ),
        Rule(
            cel="!self.model.source.startsWith('oci://') || self.cache.strategy != 'None'",
            message="an oci:// source is staged by a Job into the cache: cache.strategy None is not possible",
            check=lambda s: not s.model.source.startswith("oci://") or s.cache.strategy != "None",
        ),
    )


class LLMService(ApiModel):
    """The whole LLMService object as Metacontroller sends it."""

    model_config = ApiModel.model_config | {"extra": "ignore"}

    api_version: Literal["serving.noctaya.io/v1alpha1"] = Field(default=API_VERSION)
    kind: Literal["LLMService"] = "LLMService"
    metadata: ObjectMeta
    spec: LLMServiceSpec
    status: LLMServiceStatus | None = None

    @property
    def served_name(self) -> str:
        return self.spec.model.served_name or self.metadata.name

    crd: ClassVar[CRDInfo] = CRDInfo(
        kind="LLMService",
        plural="llmservices",
        singular="llmservice",
        scope="Namespaced",
        short_names=("llm", "llmsvc"),
        description="LLMService declares one served model: its weights, the InferenceRuntime that runs it, "
        "backend resources, scale-to-zero behaviour, model cache and the OpenAI-compatible gateway in front of it.",
        printer_columns=(
            PrinterColumn("Runtime", ".status.runtime"),
            PrinterColumn("Replicas", ".status.replicas", type="integer"),
            PrinterColumn("Ready", '.status.conditions[?(@.type=="Ready")].status'),
            PrinterColumn("Phase", ".status.phase"),
            PrinterColumn("Since", ".status.phaseSince", type="date"),
            PrinterColumn("Last Cold Start", ".status.lastColdStart.total"),
            PrinterColumn("Endpoint", ".status.endpoint", priority=1),
            PrinterColumn("Age", ".metadata.creationTimestamp", type="date"),
        ),
    )
