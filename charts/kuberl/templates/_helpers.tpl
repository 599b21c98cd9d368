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

{{/* Namespaces the operator watches when watchAllNamespaces is false (default: the release's). */}}
{{- define "kuberl.watchedNamespaces" -}}
{{- $ns := .Values.operator.namespaces | default (list .Release.Namespace) -}}
{{- toJson $ns -}}
{{- end -}}

{{- define "kuberl.webhookName" -}}
{{- printf "%s-kuberl-webhook" .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/*
RBAC rules: kept equal to kuberl.operator.builders.operator_namespaced_rules() and
operator_cluster_rules(admission) by tests/test_chart.py.
*/}}
{{- define "kuberl.namespacedRules" -}}
- apiGroups: [kuberl.io]
  resources: [agenticrljobs, rolloutfleets, sandboxpools]
  verbs: [get, list, watch, create, patch, update, delete]
- apiGroups: [kuberl.io]
  resources: [agenticrljobs/status, agenticrljobs/scale, rolloutfleets/status, rolloutfleets/scale, sandboxpools/status, sandboxpools/scale]
  verbs: [get, patch, update]
- apiGroups: ['']
  resources: [services, configmaps, serviceaccounts]
  verbs: [get, list, watch, create, patch, update, delete]
- apiGroups: [rbac.authorization.k8s.io]
  resources: [roles, rolebindings]
  verbs: [get, list, watch, create, patch, update, delete]
- apiGroups: [discovery.k8s.io]
  resources: [endpointslices]
  verbs: [get, list, watch]
- apiGroups: ['']
  resources: [pods]
  verbs: [get, list, watch]
- apiGroups: ['']
  resources: [events]
  verbs: [create, patch]
- apiGroups: [events.k8s.io]
  resources: [events]
  verbs: [create, patch]
- apiGroups: [apps]
  resources: [deployments, statefulsets]
  verbs: [get, list, watch, create, patch, update, delete]
- apiGroups: [batch]
  resources: [jobs]
  verbs: [get, list, watch, create, patch, update, delete]
- apiGroups: [networking.k8s.io]
  resources: [networkpolicies]
  verbs: [get, list, watch, create, patch, update, delete]
- apiGroups: [leaderworkerset.x-k8s.io]
  resources: [leaderworkersets]
  verbs: [get, list, watch, create, patch, update, delete]
- apiGroups: [policy]
  resources: [poddisruptionbudgets]
  verbs: [get, list, watch, create, patch, update, delete]
- apiGroups: ['']
  resources: [persistentvolumeclaims]
  verbs: [get, list, watch, create, patch]
{{- end -}}

{{- define "kuberl.clusterRules" -}}
- apiGroups: ['']
  resources: [namespaces]
  verbs: [get, list, watch]
- apiGroups: [apiextensions.k8s.io]
  resources: [customresourcedefinitions]
  verbs: [get, list, watch]
{{- if .Values.admission.enabled }}
- apiGroups: [admissionregistration.k8s.io]
  resources: [validatingwebhookconfigurations, mutatingwebhookconfigurations]
  verbs: [get, list, watch, create, patch, update]
{{- end }}
{{- end -}}
