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
RBAC rules: kept equal to kuberl.operator.render.rbac.operator_namespaced_rules() and
operator_cluster_rules() by tests/test_chart.py.
*/}}
{{- define "kuberl.namespacedRules" -}}
- apiGroups: [kuberl.io]
  resources: [agenticrljobs]
  verbs: [list, watch, patch]
- apiGroups: [kuberl.io]
  resources: [rolloutfleets, sandboxpools]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [kuberl.io]
  resources: [agenticrljobs/status, rolloutfleets/status, sandboxpools/status, rolloutfleets/scale, sandboxpools/scale]
  verbs: [patch]
- apiGroups: [kuberl.io]
  resources: [agenticrljobs/finalizers, rolloutfleets/finalizers, sandboxpools/finalizers]
  verbs: [update]
- apiGroups: ['']
  resources: [services, configmaps, secrets, serviceaccounts]
  verbs: [list, create, patch, delete]
- apiGroups: [rbac.authorization.k8s.io]
  resources: [roles, rolebindings]
  verbs: [list, create, patch, delete]
- apiGroups: [discovery.k8s.io]
  resources: [endpointslices]
  verbs: [get, list, watch]
- apiGroups: ['']
  resources: [pods]
  verbs: [list]
- apiGroups: ['']
  resources: [events]
  verbs: [list, create]
- apiGroups: [apps]
  resources: [deployments]
  verbs: [list, create, patch, delete]
- apiGroups: [batch]
  resources: [jobs]
  verbs: [list, create, patch, delete]
- apiGroups: [networking.k8s.io]
  resources: [networkpolicies]
  verbs: [list, create, patch, delete]
- apiGroups: [leaderworkerset.x-k8s.io]
  resources: [leaderworkersets]
  verbs: [list, create, patch, delete]
- apiGroups: [policy]
  resources: [poddisruptionbudgets]
  verbs: [list, create, patch, delete]
- apiGroups: ['']
  resources: [persistentvolumeclaims]
  verbs: [list, create, patch]
{{- if .Values.kueue.enabled }}
- apiGroups: [kueue.x-k8s.io]
  resources: [workloads]
  verbs: [get, list, watch, create, delete]
- apiGroups: [kueue.x-k8s.io]
  resources: [workloads/status]
  verbs: [patch]
- apiGroups: [kueue.x-k8s.io]
  resources: [localqueues]
  verbs: [get]
{{- end }}
{{- end -}}

{{/* No webhook configurations: the chart owns them (templates/webhook.yaml). */}}
{{- define "kuberl.clusterRules" -}}
- apiGroups: ['']
  resources: [namespaces]
  verbs: [list, watch]
- apiGroups: [apiextensions.k8s.io]
  resources: [customresourcedefinitions]
  verbs: [list, watch]
{{- if .Values.kueue.enabled }}
- apiGroups: [kueue.x-k8s.io]
  resources: [resourceflavors, workloadpriorityclasses]
  verbs: [get]
{{- end }}
{{- end -}}

{{/* Kept equal to kuberl.operator.render.rbac.leader_election_rules() by tests/test_chart.py. */}}
{{- define "kuberl.leaderRules" -}}
- apiGroups: [coordination.k8s.io]
  resources: [leases]
  verbs: [get, create, patch]
{{- end -}}
