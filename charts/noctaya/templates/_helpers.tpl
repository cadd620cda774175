{{/* The hook server's image; the hooks render gateway Pods with the same one (NOCTAYA_IMAGE). */}}
{{- define "noctaya.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{/* The Secret holding hook-token and token-key: the user's, or the one this chart keeps. */}}
{{- define "noctaya.hookSecret" -}}
{{ .Values.hooks.existingSecret | default "noctaya-hooks" }}
{{- end -}}

{{/* The hook server's TLS Secret (tls.crt, tls.key, ca.crt): the user's, or the one this chart keeps. */}}
{{- define "noctaya.hookTLSSecret" -}}
{{ .Values.hooks.tls.existingSecret | default "noctaya-hooks-tls" }}
{{- end -}}

{{/*
Fails the render, naming every value it lacks, when secret material would have to be invented while
rendering and hooks.generateSecrets does not allow it. A render that cannot see the cluster (helm
template, Argo CD, helm lint) finds nothing by lookup, and a token or CA drawn at random there changes
on every render while Metacontroller keeps the old one: every hook call would then get 401 or fail TLS.
A Secret that lookup finds complete (an install or upgrade where it exists) is reused, so an upgrade
from a chart that generated them needs no new values.
*/}}
{{- define "noctaya.requireSecretInputs" -}}
{{- if not .Values.hooks.generateSecrets }}
{{- $missing := list }}
{{- if not .Values.hooks.existingSecret }}
{{- $hook := lookup "v1" "Secret" .Release.Namespace "noctaya-hooks" }}
{{- if not (and (dig "data" "hook-token" "" $hook) (dig "data" "token-key" "" $hook)) }}
{{- $missing = append $missing "hooks.existingSecret (a Secret with keys hook-token and token-key)" }}
{{- end }}
{{- end }}
{{- if not .Values.hooks.tls.existingSecret }}
{{- $tls := lookup "v1" "Secret" .Release.Namespace "noctaya-hooks-tls" }}
{{- if not (and (dig "data" "tls.crt" "" $tls) (dig "data" "tls.key" "" $tls) (dig "data" "ca.crt" "" $tls)) }}
{{- $missing = append $missing (printf "hooks.tls.existingSecret (a kubernetes.io/tls Secret with tls.crt, tls.key and ca.crt for noctaya-hooks.%s.svc, e.g. cert-manager's: examples/security/hook-server-cert-manager.yaml)" .Release.Namespace) }}
{{- end }}
{{- end }}
{{- if $missing }}
{{- fail (printf "set %s. Secret material is never generated while rendering unless hooks.generateSecrets is true: a render that cannot see the cluster (helm template, Argo CD) would draw a new token and CA each time, and every hook call would then fail (docs/install.md, \"GitOps (Argo CD, Flux)\"). With helm install or helm upgrade, hooks.generateSecrets=true creates them once and keeps them." (join " and " $missing)) }}
{{- end }}
{{- end }}
{{- end -}}
