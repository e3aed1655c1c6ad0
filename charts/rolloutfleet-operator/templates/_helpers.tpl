{{- define "rolloutfleet-operator.name" -}}rolloutfleet-operator{{- end -}}

{{- define "rolloutfleet-operator.labels" -}}
app.kubernetes.io/name: rolloutfleet-operator
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "rolloutfleet-operator.selectorLabels" -}}
app.kubernetes.io/name: rolloutfleet-operator
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "rolloutfleet-operator.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}{{ default (printf "%s-rolloutfleet-operator" .Release.Name) .Values.serviceAccount.name }}{{- else -}}{{ required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name }}{{- end -}}
{{- end -}}

{{/* What the operator does to fleets and their children; nothing more. */}}
{{- define "rolloutfleet-operator.namespacedRules" -}}
- apiGroups: [rolloutfleet.dev]
  resources: [rolloutfleets]
  verbs: [get, list, watch, patch, update]
- apiGroups: [rolloutfleet.dev]
  resources: [rolloutfleets/status]
  verbs: [get, patch, update]
# Children carry blockOwnerDeletion; clusters enforcing OwnerReferencesPermission require this.
- apiGroups: [rolloutfleet.dev]
  resources: [rolloutfleets/finalizers]
  verbs: [update]
- apiGroups: [""]
  resources: [pods]
  verbs: [get, list, watch, create, delete, patch]
# Rolling updates and memory restarts evict Ready proxies, so their PodDisruptionBudget is honoured.
- apiGroups: [""]
  resources: [pods/eviction]
  verbs: [create]
- apiGroups: [""]
  resources: [services, serviceaccounts]
  verbs: [get, list, watch, create, patch, update, delete]
- apiGroups: [""]
  resources: [secrets]
  verbs: [get, create]
- apiGroups: [apps]
  resources: [deployments]
  verbs: [get, list, watch, create, patch, update, delete]
- apiGroups: [policy]
  resources: [poddisruptionbudgets]
  verbs: [get, list, watch, create, patch, update, delete]
- apiGroups: [networking.k8s.io]
  resources: [networkpolicies]
  verbs: [get, list, watch, create, patch, update, delete]
- apiGroups: [rbac.authorization.k8s.io]
  resources: [roles, rolebindings]
  verbs: [get, list, watch, create, patch, update, delete]
# Events: posted and counted (patch); listed only while a pod waits for its volumes, to say why (FailedMount).
- apiGroups: ["", events.k8s.io]
  resources: [events]
  verbs: [create, patch, list]
{{- end -}}

{{/* The operator's NetworkPolicy settings (ROLLOUTFLEET_NETWORK_POLICY): compact JSON. */}}
{{- define "rolloutfleet-operator.networkPolicy" -}}
{{- $policy := dict "operatorNamespace" .Release.Namespace -}}
{{- with .Values.networkPolicy.clients }}{{ $_ := set $policy "clients" . }}{{ end -}}
{{- with .Values.networkPolicy.clientNamespaces }}{{ $_ := set $policy "clientNamespaces" . }}{{ end -}}
{{- with .Values.networkPolicy.scrapeNamespaces }}{{ $_ := set $policy "scrapeNamespaces" . }}{{ end -}}
{{- toJson $policy -}}
{{- end -}}

{{/* An image reference: `<registry>/<name>:<tag>`, or `<name>:<tag>` without a registry (a local image). */}}
{{- define "rolloutfleet-operator.imageRef" -}}
{{- $registry := trimSuffix "/" (.registry | default "") -}}
{{- if $registry -}}{{ printf "%s/%s:%s" $registry .name .tag }}{{- else -}}{{ printf "%s:%s" .name .tag }}{{- end -}}
{{- end -}}

{{/* The tag of the project's images: image.tag, else the chart's appVersion (the package version). */}}
{{- define "rolloutfleet-operator.tag" -}}{{ .Values.image.tag | default .Chart.AppVersion }}{{- end -}}

{{/* The sglang-router release of the default gateway image (the operator's SGLANG_ROUTER_VERSION;
tests/test_chart.py keeps them equal). */}}
{{- define "rolloutfleet-operator.routerVersion" -}}0.3.2{{- end -}}

{{- define "rolloutfleet-operator.operatorImage" -}}
{{- include "rolloutfleet-operator.imageRef" (dict "registry" .Values.image.registry "name" .Values.image.repository "tag" (include "rolloutfleet-operator.tag" .)) -}}
{{- end -}}

{{/* ROLLOUTFLEET_DEFAULT_PROXY_IMAGE: the proxy of this release, from the same registry and tag. */}}
{{- define "rolloutfleet-operator.proxyImage" -}}
{{- .Values.fleetDefaults.proxyImage | default (include "rolloutfleet-operator.imageRef" (dict "registry" .Values.image.registry "name" "rolloutfleet-proxy" "tag" (include "rolloutfleet-operator.tag" .))) -}}
{{- end -}}

{{/* ROLLOUTFLEET_DEFAULT_GATEWAY_IMAGE: fleetDefaults.gatewayImage, else the router image under
image.registry; empty (the operator's own default, a local name) with neither. */}}
{{- define "rolloutfleet-operator.gatewayImage" -}}
{{- if .Values.fleetDefaults.gatewayImage -}}{{ .Values.fleetDefaults.gatewayImage }}
{{- else if .Values.image.registry -}}{{ include "rolloutfleet-operator.imageRef" (dict "registry" .Values.image.registry "name" "rolloutfleet-sglang-router" "tag" (include "rolloutfleet-operator.routerVersion" .)) }}
{{- end -}}
{{- end -}}
