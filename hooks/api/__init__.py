"""Typed API of `serving.noctaya.io/v1alpha1`: the single source of truth for the CRDs."""

from hooks.api.common import API_VERSION, GROUP, VERSION
from hooks.api.llmservice import LLMService, LLMServiceSpec, ModelSource, parse_model_source
from hooks.api.runtime import InferenceRuntime, InferenceRuntimeSpec
from hooks.api.status import Condition, InferenceRuntimeStatus, LLMServiceStatus

__all__ = [
    "API_VERSION",
    "GROUP",
    "VERSION",
    "Condition",
    "InferenceRuntime",
    "InferenceRuntimeSpec",
    "InferenceRuntimeStatus",
    "LLMService",
    "LLMServiceSpec",
    "LLMServiceStatus",
    "ModelSource",
    "parse_model_source",
]
