//! The test containerd itself, through k8s-cri over its unix socket.

// The root tier: compiled empty without `--features root-tests` (see Cargo.toml).
#![cfg(feature = "root-tests")]

use std::net::IpAddr;

use k8s_cri::v1::runtime_service_client::RuntimeServiceClient;
use k8s_cri::v1::{
    ContainerConfig, ContainerMetadata, ContainerState, CreateContainerRequest, ImageSpec,
    ListContainersRequest, ListPodSandboxRequest, PodSandboxState, StartContainerRequest,
};
use testenv::Containerd;
use testenv::containerd::SANDBOX_IMAGE;
use tonic::transport::Channel;

async fn sandbox_state_and_ip(containerd: &Containerd, id: &str) -> (i32, String) {
    let status = containerd
        .sandbox_status(id, false)
        .await
        .expect("PodSandboxStatus")
        .status
        .expect("a sandbox status");
    let ip = status.network.map(|n| n.ip).unwrap_or_default();
    (status.state, ip)
}

async fn sandbox_ids(client: &mut RuntimeServiceClient<Channel>) -> Vec<(String, i32)> {
    client
        .list_pod_sandbox(ListPodSandboxRequest::default())
        .await
        .expect("ListPodSandbox")
        .into_inner()
        .items
        .into_iter()
        .map(|s| (s.id, s.state))
        .collect()
}

async fn container_states(client: &mut RuntimeServiceClient<Channel>) -> Vec<(String, i32)> {
    client
        .list_containers(ListContainersRequest::default())
        .await
        .expect("ListContainers")
        .into_inner()
        .containers
        .into_iter()
        .map(|c| (c.id, c.state))
        .collect()
}

#[tokio::test]
async fn sandbox_lifecycle_with_an_ip_through_cri() {
    let containerd = Containerd::start_for_test().await;
    let mut client = containerd.client().await.expect("CRI client");
    let config = containerd.sandbox_config("web-0", "uid-web-0", "cri-test");

    // Run: READY, with an address from the test CNI plugin.
    let id = containerd
        .run_sandbox("web-0", "uid-web-0", "cri-test")
        .await
        .unwrap_or_else(|e| panic!("{e:#}"));
    let (state, ip) = sandbox_state_and_ip(&containerd, &id).await;
    assert_eq!(state, PodSandboxState::SandboxReady as i32);
    let ip: IpAddr = ip
        .parse()
        .unwrap_or_else(|_| panic!("sandbox IP {ip:?} is not an address"));
    let net: ipnet::IpNet = testenv::containerd::CNI_SUBNET.parse().unwrap();
    assert!(net.contains(&ip), "{ip} comes from the test plugin's range");
    assert_eq!(
        sandbox_ids(&mut client).await,
        [(id.clone(), PodSandboxState::SandboxReady as i32)]
    );

    // A container in it (the sandbox image doubles as the container image).
    let cid = client
        .create_container(CreateContainerRequest {
            pod_sandbox_id: id.clone(),
            config: Some(ContainerConfig {
                metadata: Some(ContainerMetadata {
                    name: "app".into(),
                    attempt: 0,
                }),
                image: Some(ImageSpec {
                    image: SANDBOX_IMAGE.into(),
                    ..Default::default()
                }),
                log_path: "app.log".into(),
                ..Default::default()
            }),
            sandbox_config: Some(config),
        })
        .await
        .expect("CreateContainer")
        .into_inner()
        .container_id;
    assert_eq!(
        container_states(&mut client).await,
        [(cid.clone(), ContainerState::ContainerCreated as i32)]
    );
    client
        .start_container(StartContainerRequest {
            container_id: cid.clone(),
        })
        .await
        .expect("StartContainer");
    assert_eq!(
        container_states(&mut client).await,
        [(cid.clone(), ContainerState::ContainerRunning as i32)]
    );

    // Stop: NOTREADY and no IP any more; its container exited.
    containerd.stop_sandbox(&id).await.expect("StopPodSandbox");
    let (state, ip) = sandbox_state_and_ip(&containerd, &id).await;
    assert_eq!(state, PodSandboxState::SandboxNotready as i32);
    assert_eq!(ip, "", "a stopped sandbox reports no IP");
    assert_eq!(
        sandbox_ids(&mut client).await,
        [(id.clone(), PodSandboxState::SandboxNotready as i32)]
    );
    assert_eq!(
        container_states(&mut client).await,
        [(cid, ContainerState::ContainerExited as i32)]
    );

    // Remove: gone from both listings.
    containerd
        .remove_sandbox(&id)
        .await
        .expect("RemovePodSandbox");
    assert_eq!(sandbox_ids(&mut client).await, []);
    assert_eq!(container_states(&mut client).await, []);
    let gone = containerd
        .sandbox_status(&id, false)
        .await
        .expect_err("status of a removed sandbox");
    assert_eq!(gone.code(), tonic::Code::NotFound);
}

#[tokio::test]
async fn each_sandbox_gets_its_own_ip() {
    let containerd = Containerd::start_for_test().await;
    let mut ips = Vec::new();
    for i in 0..3 {
        let id = containerd
            .run_sandbox(&format!("p{i}"), &format!("uid-{i}"), "cri-test")
            .await
            .expect("RunPodSandbox");
        ips.push(sandbox_state_and_ip(&containerd, &id).await.1);
    }
    let mut unique = ips.clone();
    unique.sort();
    unique.dedup();
    assert_eq!(unique.len(), 3, "{ips:?}");
}
