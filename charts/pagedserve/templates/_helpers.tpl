{{/* The release's full name, DNS-safe. */}}
{{- define "pagedserve.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "pagedserve.labels" -}}
app.kubernetes.io/name: pagedserve
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "pagedserve.operatorSelector" -}}
app.kubernetes.io/name: pagedserve
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{- define "pagedserve.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{/* The namespaces the operator watches (with allNamespaces: none, it watches all). */}}
{{- define "pagedserve.watchNamespaces" -}}
{{- if .Values.operator.watchNamespaces -}}
{{- toJson .Values.operator.watchNamespaces -}}
{{- else -}}
{{- toJson (list .Release.Namespace) -}}
{{- end -}}
{{- end -}}

{{- define "pagedserve.modelName" -}}
{{- .Values.model.name | default (include "pagedserve.fullname" .) -}}
{{- end -}}

{{- define "pagedserve.policyName" -}}
{{- .Values.autoscalingPolicy.name | default (include "pagedserve.fullname" .) -}}
{{- end -}}

{{/* Hardened container defaults: the same for the operator as for the model pods (operator/specs.py). */}}
{{- define "pagedserve.containerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities: {drop: [ALL]}
{{- end -}}
