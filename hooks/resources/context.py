"""What every builder reads: the parsed LLMService, its resolved runtime, namespace and config."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hooks.api.common import duration_seconds
from hooks.api.llmservice import LLMService
from hooks.api.runtime import InferenceRuntime
from hooks.config import HookConfig
from hooks.resources import labels, names


@dataclass(frozen=True)
class RenderContext:
    service: LLMService
    runtime: InferenceRuntime
    namespace: str
    config: HookConfig
    uid: str = ""
    # Seconds of the last cold start the status recorded (leadTime `auto`); read from the parent's
    # status, which the spec model does not parse.
    measured_cold_start: int | None = None
    # Whether the gateway gets an identity of its own (ServiceAccount, RoleBinding) and balances over
    # the backend's Pods: only when the calling controller manages those child types
    # (hooks.controller.observe.Observed.lists_children); else it reaches the backend Service.
    gateway_identity: bool = True

    @property
    def name(self) -> str:
        return self.service.metadata.name

    @property
    def shared_gateway(self) -> str | None:
        """The LLMGateway this model joins (spec.endpoint.gateway), or None for a gateway of its own."""
        return self.service.spec.endpoint.gateway

    @property
    def multi_gateway(self) -> bool:
        # A member renders no gateway of its own (and its replicas are 1 by the API's rules anyway).
        return self.shared_gateway is None and self.service.spec.endpoint.replicas > 1

    def host(self, service_name: str) -> str:
        return names.service_host(service_name, self.namespace, self.config.cluster_domain)

    def metadata(self, name: str, component: str, annotations: dict[str, str] | None = None) -> dict[str, Any]:
        meta: dict[str, Any] = {"name": name, "namespace": self.namespace, "labels": labels.labels(self.name, component)}
        if annotations:
            meta["annotations"] = dict(sorted(annotations.items()))
        return meta

    def service_object(
        self, name: str, component: str, selects: str, ports: list[dict[str, Any]],
        *, service_type: str = "ClusterIP", annotations: dict[str, str] | None = None,
    ) -> dict[str, Any]:
        """A Service of this LLMService, labelled `component`, selecting the Pods of `selects`."""
        return service_object(self.metadata(name, component, annotations), labels.selector(self.name, selects), ports,
                              service_type)

    def seconds(self, duration: str) -> int:
        return int(duration_seconds(duration))

    @property
    def scaler_address(self) -> str:
        """host:port KEDA dials for the external-push trigger: the internal scaler Service, this model's own
        or, for a member of a shared gateway, the LLMGateway's (same gRPC port)."""
        gateway = self.shared_gateway
        scaler = names.scaler(self.name) if gateway is None else names.shared_scaler(gateway)
        return f"{self.host(scaler)}:{SCALER_GRPC_PORT}"

    @property
    def endpoint_url(self) -> str:
        return endpoint_url(self.name, self.namespace, self.config, self.shared_gateway)


SCALER_GRPC_PORT = 9090
REPORT_PORT = 9091
GATEWAY_PORT = 8080
ADMIN_PORT = 9092  # the gateway's /metrics and /noctaya/queue (never on a Service)
PUBLIC_PORT = 80
METRIC_NAME = "noctaya-demand"


def service_object(metadata: dict[str, Any], selector: dict[str, str], ports: list[dict[str, Any]],
                   service_type: str = "ClusterIP") -> dict[str, Any]:
    """A Service of any owner selecting the Pods `selector` picks."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata,
        "spec": {"type": service_type, "selector": selector, "ports": ports},
    }


def tcp_port(name: str, port: int, **extra: str) -> dict[str, Any]:
    """A Service port whose targetPort is the container port of the same name."""
    return {"name": name, "port": port, "targetPort": name, "protocol": "TCP", **extra}


def endpoint_url(service: str, namespace: str, config: HookConfig, gateway: str | None = None) -> str:
    """The OpenAI base URL clients use: the LLMService's own public Service, or the shared one of the
    LLMGateway `gateway` it joins."""
    public = names.public_service(service) if gateway is None else names.shared_gateway(gateway)
    return f"http://{names.service_host(public, namespace, config.cluster_domain)}/v1"
