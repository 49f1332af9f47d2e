fn main() -> Result<(), Box<dyn std::error::Error>> {
    tonic_prost_build::configure()
        .compile_protos(&["proto/weft/cni/v1/cni.proto", "proto/weft/flows/v1/flows.proto"], &["proto"])?;
    Ok(())
}
