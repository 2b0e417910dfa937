//! The Kubernetes example (`deploy/kubernetes.yaml`) as an operator applies
//! it: every document parses, the router's config in it is one the router
//! accepts, and the parts agree with each other (ports, labels, the peers'
//! headless Service, readiness on warm-up, the capabilities XDP needs).

use prefix_router::config::Config;
use yaml_rust2::{Yaml, YamlLoader};

fn docs() -> Vec<Yaml> {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../deploy/kubernetes.yaml");
    let text = std::fs::read_to_string(path).expect("deploy/kubernetes.yaml");
    YamlLoader::load_from_str(&text).expect("valid YAML")
}

fn find<'a>(docs: &'a [Yaml], kind: &str, name: &str) -> &'a Yaml {
    docs.iter()
        .find(|d| d["kind"].as_str() == Some(kind) && d["metadata"]["name"].as_str() == Some(name))
        .unwrap_or_else(|| panic!("no {kind} {name}"))
}

fn strs(y: &Yaml) -> Vec<&str> {
    y.as_vec()
        .map(|v| v.iter().filter_map(Yaml::as_str).collect())
        .unwrap_or_default()
}

/// The container port named `name`.
fn port(container: &Yaml, name: &str) -> i64 {
    container["ports"]
        .as_vec()
        .and_then(|ps| ps.iter().find(|p| p["name"].as_str() == Some(name)))
        .and_then(|p| p["containerPort"].as_i64())
        .unwrap_or_else(|| panic!("no container port {name}"))
}

#[test]
fn the_kubernetes_example_is_consistent_and_its_config_is_accepted() {
    let docs = docs();
    let cm = find(&docs, "ConfigMap", "prefix-router");
    let toml_text = cm["data"]["prefix-router.toml"]
        .as_str()
        .expect("the router's config");
    let cfg: Config = toml::from_str(toml_text).expect("the config parses");
    cfg.validate().expect("the router accepts the config");
    let r = &cfg.replicas;
    assert!(r.enabled() && r.key_file.is_some() && r.key.is_none());
    let stream = r.listen.expect("replicas.listen").port();

    let dep = find(&docs, "Deployment", "prefix-router");
    assert_eq!(dep["spec"]["replicas"].as_i64(), Some(3));
    let labels = &dep["spec"]["template"]["metadata"]["labels"];
    assert_eq!(&dep["spec"]["selector"]["matchLabels"], labels);
    let c = &dep["spec"]["template"]["spec"]["containers"][0];
    assert_eq!(port(c, "traffic"), i64::from(cfg.listen.port()));
    assert_eq!(port(c, "replica"), i64::from(stream));
    assert_eq!(port(c, "replica-snap"), i64::from(stream) + 1);
    let admin = cfg.admin.listen.expect("admin.listen");
    assert_eq!(port(c, "admin"), i64::from(admin.port()));
    assert!(
        admin.ip().is_unspecified(),
        "the kubelet probes the pod's address"
    );
    // Ready when warm, alive when the process answers.
    assert_eq!(
        c["readinessProbe"]["httpGet"]["path"].as_str(),
        Some("/ready")
    );
    assert_eq!(
        c["livenessProbe"]["httpGet"]["path"].as_str(),
        Some("/health")
    );
    let caps = strs(&c["securityContext"]["capabilities"]["add"]);
    for need in ["BPF", "PERFMON", "NET_ADMIN"] {
        assert!(caps.contains(&need), "{need} missing from {caps:?}");
    }
    let args = strs(&c["args"]);
    let config_path = args[args
        .iter()
        .position(|a| *a == "--config")
        .expect("--config")
        + 1];
    // The config and the key file are where the volumes put them.
    let mounts = c["volumeMounts"].as_vec().expect("mounts");
    let mounted = |path: &str| {
        mounts.iter().any(|m| {
            m["mountPath"]
                .as_str()
                .is_some_and(|p| path.starts_with(p) && path[p.len()..].matches('/').count() == 1)
        })
    };
    assert!(mounted(config_path), "{config_path} is not mounted");
    let key_file = r.key_file.as_ref().unwrap().to_str().unwrap();
    assert!(mounted(key_file), "{key_file} is not mounted");

    // The peers: a headless Service over the same pods, not-ready ones
    // included (a starting replica catches up through it), on both ports,
    // named as the config's `replicas.dns`.
    let peers = find(&docs, "Service", "prefix-router-peers");
    assert_eq!(peers["spec"]["clusterIP"].as_str(), Some("None"));
    assert_eq!(
        peers["spec"]["publishNotReadyAddresses"].as_bool(),
        Some(true)
    );
    assert_eq!(&peers["spec"]["selector"], labels);
    let dns = r.dns.as_deref().expect("replicas.dns");
    let ns = peers["metadata"]["namespace"].as_str().unwrap();
    assert_eq!(dns, format!("prefix-router-peers.{ns}.svc.cluster.local"));
    assert_eq!(r.dns_port, Some(stream));
    let peer_ports: Vec<i64> = peers["spec"]["ports"]
        .as_vec()
        .unwrap()
        .iter()
        .filter_map(|p| p["port"].as_i64())
        .collect();
    assert_eq!(peer_ports, [i64::from(stream), i64::from(stream) + 1]);

    // The traffic Service reaches the traffic port only.
    let svc = find(&docs, "Service", "prefix-router");
    assert_eq!(&svc["spec"]["selector"], labels);
    let targets = svc["spec"]["ports"].as_vec().unwrap();
    assert_eq!(targets.len(), 1);
    assert_eq!(targets[0]["targetPort"].as_str(), Some("traffic"));
}
