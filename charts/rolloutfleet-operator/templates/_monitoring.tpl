{{/* "true" when the monitoring.coreos.com objects render: asked for, and the cluster serves their API
(or monitoring.force: `helm template` without a cluster knows no custom APIs). */}}
{{- define "rolloutfleet-operator.monitors" -}}
{{- if and .Values.monitoring.enabled (or .Values.monitoring.force (.Capabilities.APIVersions.Has "monitoring.coreos.com/v1")) -}}
true
{{- end -}}
{{- end -}}

{{/* The chart's labels plus monitoring.labels, which Prometheus's ruleSelector and
serviceMonitorSelector / podMonitorSelector match (e.g. release: prometheus). */}}
{{- define "rolloutfleet-operator.monitoringLabels" -}}
{{ include "rolloutfleet-operator.labels" . }}
{{- with .Values.monitoring.labels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Where fleets live: the watched namespaces, else every namespace. */}}
{{- define "rolloutfleet-operator.fleetNamespaces" -}}
{{- if .Values.watchNamespaces -}}
matchNames: {{ toJson .Values.watchNamespaces }}
{{- else -}}
any: true
{{- end -}}
{{- end -}}

{{/* Copies the children's fleet label (rolloutfleet.dev/fleet) to `fleet`, the label the operator's own
series carry, so proxy, gateway and operator series join on (namespace, fleet). */}}
{{- define "rolloutfleet-operator.fleetRelabeling" -}}
- sourceLabels: [__meta_kubernetes_{{ . }}_label_rolloutfleet_dev_fleet]
  targetLabel: fleet
{{- end -}}
