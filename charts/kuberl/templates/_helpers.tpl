{{- define "kuberl.fullname" -}}
{{- printf "%s-kuberl-operator" .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "kuberl.serviceAccountName" -}}
{{- default (include "kuberl.fullname" .) .Values.serviceAccount.name -}}
{{- end -}}

{{- define "kuberl.labels" -}}
app.kubernetes.io/name: kuberl
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "kuberl.monitoringLabels" -}}
{{ include "kuberl.labels" . }}
release: {{ .Values.monitoring.release | quote }}
{{- end -}}
