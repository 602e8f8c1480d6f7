{{/*
Names. Kubernetes object names and label values stop at 63 characters (DNS-1123 labels), so every
name is cut there and loses a trailing "-" the cut may leave. Suffixed names cut the base first so
the suffix survives: "<base cut to 63-len(suffix)>-<suffix>".
*/}}

{{- define "mambaserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "mambaserve.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* "<fullname>-<suffix>" within 63 characters; call with (list $ "suffix"). */}}
{{- define "mambaserve.suffixed" -}}
{{- $root := index . 0 -}}
{{- $suffix := index . 1 -}}
{{- $base := include "mambaserve.fullname" $root | trunc (int (sub 62 (len $suffix))) | trimSuffix "-" -}}
{{- printf "%s-%s" $base $suffix -}}
{{- end -}}

{{- define "mambaserve.operator.fullname" -}}
{{- include "mambaserve.suffixed" (list . "operator") -}}
{{- end -}}

{{- define "mambaserve.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "mambaserve.operator.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "mambaserve.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Labels of every object; call with (list $ "component"). */}}
{{- define "mambaserve.labels" -}}
{{- $root := index . 0 -}}
helm.sh/chart: {{ include "mambaserve.chart" $root }}
{{ include "mambaserve.selectorLabels" . }}
app.kubernetes.io/version: {{ $root.Chart.AppVersion | trunc 63 | trimSuffix "-" | quote }}
app.kubernetes.io/part-of: mambaserve
app.kubernetes.io/managed-by: {{ $root.Release.Service }}
{{- with $root.Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/*
Selector labels. The operator labels the pods it creates with app.kubernetes.io/name=mambaserve
and app.kubernetes.io/instance=<session name> too; the component keeps the two apart.
*/}}
{{- define "mambaserve.selectorLabels" -}}
{{- $root := index . 0 -}}
app.kubernetes.io/name: {{ include "mambaserve.name" $root }}
app.kubernetes.io/instance: {{ $root.Release.Name | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end -}}

{{/* Images, each "repository:tag" (values.schema.json refuses an empty or `latest` tag). */}}
{{- define "mambaserve.operator.image" -}}
{{- printf "%s:%s" .Values.operator.image.repository .Values.operator.image.tag -}}
{{- end -}}

{{- define "mambaserve.server.image" -}}
{{- printf "%s:%s" .Values.server.image.repository .Values.server.image.tag -}}
{{- end -}}

{{/* Labels of monitoring objects: the chart's plus those a Prometheus selects on. */}}
{{- define "mambaserve.monitoringLabels" -}}
{{- $root := index . 0 -}}
{{ include "mambaserve.labels" . }}
{{- with $root.Values.monitoring.labels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/*
The operator's API access, shared by the ClusterRole (cluster-wide mode) and the per-namespace
Roles (namespaced mode). Each rule is exactly what the code in operator/ does; tests/charts runs the
real operator and checks every request it makes against these rules.
*/}}
{{- define "mambaserve.operatorRules" -}}
# Kopf lists and watches the two kinds and patches their finalizers and progress annotations;
# the reconciler lists InferenceSessions to find those bound to a CacheTier and reads CacheTiers.
- apiGroups: ["mambaserve.io"]
  resources: ["inferencesessions"]
  verbs: ["list", "watch", "patch"]
- apiGroups: ["mambaserve.io"]
  resources: ["cachetiers"]
  verbs: ["get", "list", "watch", "patch"]
# Owner references with blockOwnerDeletion: where the OwnerReferencesPermissionEnforcement admission
# plugin is on (OpenShift), setting one needs update on the owner's finalizers subresource.
- apiGroups: ["mambaserve.io"]
  resources: ["inferencesessions/finalizers", "cachetiers/finalizers"]
  verbs: ["update"]
# Status is a subresource of both CRDs; the operator writes it and nothing else does.
- apiGroups: ["mambaserve.io"]
  resources: ["inferencesessions/status", "cachetiers/status"]
  verbs: ["patch"]
# Kopf posts Kubernetes events about the objects it handles.
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create"]
# Server pods are listed to scrape their /metrics for status. get and watch are not used by the
# operator itself: it needs them because the router Role it creates grants them, and RBAC only
# lets a subject grant permissions it holds (escalation prevention).
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["get", "list", "watch"]
# Children of an InferenceSession: server-side applied (patch; create when the apply creates the
# object), read (get), re-created when an immutable field changes (delete), pruned by label when
# stale (list, delete). The optional kinds (KEDA, prometheus-operator) are listed on every prune even
# when unused, so they are always granted.
- apiGroups: [""]
  resources: ["configmaps", "services", "serviceaccounts"]
  verbs: ["get", "list", "create", "patch", "delete"]
- apiGroups: ["apps"]
  resources: ["deployments", "statefulsets"]
  verbs: ["get", "list", "create", "patch", "delete"]
- apiGroups: ["policy"]
  resources: ["poddisruptionbudgets"]
  verbs: ["get", "list", "create", "patch", "delete"]
- apiGroups: ["autoscaling"]
  resources: ["horizontalpodautoscalers"]
  verbs: ["get", "list", "create", "patch", "delete"]
- apiGroups: ["rbac.authorization.k8s.io"]
  resources: ["roles", "rolebindings"]
  verbs: ["get", "list", "create", "patch", "delete"]
- apiGroups: ["keda.sh"]
  resources: ["scaledobjects"]
  verbs: ["get", "list", "create", "patch", "delete"]
- apiGroups: ["monitoring.coreos.com"]
  resources: ["servicemonitors"]
  verbs: ["get", "list", "create", "patch", "delete"]
# Claims: a CacheTier's shared storage claim and a session's model cache. Server-side applied (a
# bound claim's spec never changes: only labels may), deleted with their owner; model caches are
# pruned by label.
- apiGroups: [""]
  resources: ["persistentvolumeclaims"]
  verbs: ["get", "list", "create", "patch", "delete"]
# The Job that downloads a session's model into its model cache claim (re-created on a new revision).
- apiGroups: ["batch"]
  resources: ["jobs"]
  verbs: ["get", "list", "create", "patch", "delete"]
{{- end -}}

{{/*
Cluster-scoped reads Kopf makes in both modes: it watches CRDs so that CRDs upgraded outside Helm
(kubectl apply, see the chart README) are re-discovered without restarting the operator.
*/}}
{{- define "mambaserve.crdRules" -}}
- apiGroups: ["apiextensions.k8s.io"]
  resources: ["customresourcedefinitions"]
  verbs: ["list", "watch"]
{{- end -}}
