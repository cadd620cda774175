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
