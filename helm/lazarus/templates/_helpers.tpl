{{- define "lazarus.fullname" -}}
{{- printf "%s-operator" .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "lazarus.serviceAccountName" -}}
{{- default (include "lazarus.fullname" .) .Values.serviceAccount.name -}}
{{- end -}}

{{- define "lazarus.labels" -}}
app.kubernetes.io/name: lazarus
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "lazarus.selectorLabels" -}}
app.kubernetes.io/name: lazarus
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}
